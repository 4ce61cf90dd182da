//! The stand-in inference server: see `specd_e2e::standin`.

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(specd_e2e::standin::run(argv));
}
