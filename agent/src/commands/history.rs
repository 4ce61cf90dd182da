//! `specd history UNIT`: what specd did to a unit, newest last.

use crate::core::record;
use crate::machine::store::Store;
use crate::reconcile::context::Dirs;
use anyhow::Result;
use specd_spec::short;

pub async fn history(dirs: &Dirs, unit: Option<String>, json: bool) -> Result<u8> {
    let store = Store::new(&dirs.state_dir);
    let units = match unit {
        Some(u) => vec![u],
        None => store.units()?,
    };
    let mut all = Vec::new();
    for u in &units {
        let st = store.peek(u)?;
        for h in &st.history {
            all.push((u.clone(), h.clone()));
        }
    }
    all.sort_by_key(|(_, h)| h.time);
    if json {
        let v: Vec<serde_json::Value> = all
            .iter()
            .map(|(u, h)| {
                let mut v = serde_json::to_value(h).unwrap_or_default();
                v["unit"] = serde_json::json!(u);
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    for (u, h) in &all {
        let src = h.source.as_ref().map_or("-".into(), |s| s.to_string());
        println!(
            "{}  {u}  {:<11} unit {}  {src}",
            record::format_time(h.time),
            format!("{:?}", h.outcome),
            short(&h.sha256)
        );
        println!("    {}", h.message);
        if let Some(v) = &h.stop_verdict {
            println!("    previous instance: {v}");
        }
        if let Some(s) = &h.startup {
            println!("    start: {}", s.describe());
        }
    }
    if all.is_empty() {
        println!("no applies recorded");
    }
    Ok(0)
}
