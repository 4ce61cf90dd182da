//! Boots and tears down the systemd box N times (default 20) and prints a
//! table of boot, teardown and total times (min, median, max).
//!
//! `box-bench [N]`; run as root.

use specd_e2e::SystemdBox;
use std::time::{Duration, Instant};

fn stats(mut v: Vec<Duration>) -> (Duration, Duration, Duration) {
    v.sort();
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(20);
    let (mut boot, mut down, mut total) = (Vec::new(), Vec::new(), Vec::new());
    let mut unclean = 0;
    for _ in 0..n {
        let t = Instant::now();
        let b = SystemdBox::boot()?;
        let booted = t.elapsed();
        let td = b.shutdown()?;
        if !td.clean_poweroff {
            unclean += 1;
        }
        boot.push(booted);
        down.push(td.elapsed);
        total.push(t.elapsed());
    }
    println!("systemd box, {n} runs ({unclean} needed a SIGKILL at teardown)");
    println!("{:<22} {:>9} {:>11} {:>9}", "phase", "min ms", "median ms", "max ms");
    for (name, v) in [("boot (to running)", boot), ("teardown (leak-checked)", down), ("boot + teardown", total)] {
        let (lo, mid, hi) = stats(v);
        println!("{:<22} {:>9} {:>11} {:>9}", name, ms(lo), ms(mid), ms(hi));
    }
    Ok(())
}
