//! The GPUs' memory, as NVIDIA's `nvidia-smi` reports it (its reading is `core::gpu`'s).

use std::path::Path;
use std::time::Duration;

/// How long `nvidia-smi` may take to answer (it waits on the driver); killed after.
pub const NVIDIA_SMI_WITHIN: Duration = Duration::from_secs(10);

/// The query, one line per GPU: `0, GPU-2762b558-…, 21246, 23034` (memory in MiB).
pub const QUERY: [&str; 2] = ["--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"];

/// `nvidia-smi`'s answer to [`QUERY`] on a host with NVIDIA devices (`dev` has an `nvidiaN`
/// node); `None` on a host without. `Err`: it could not be run, or failed (its words).
pub async fn memory(dev: &Path) -> Option<Result<String, String>> {
    if nvidia_devices(dev).is_empty() {
        return None;
    }
    let run = tokio::process::Command::new("nvidia-smi").args(QUERY).kill_on_drop(true).output();
    Some(match tokio::time::timeout(NVIDIA_SMI_WITHIN, run).await {
        Err(_) => Err(format!("nvidia-smi did not answer within {} s", NVIDIA_SMI_WITHIN.as_secs())),
        Ok(Err(e)) => Err(format!("nvidia-smi: {e}")),
        Ok(Ok(o)) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(Ok(o)) => {
            let said = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
            Err(format!("nvidia-smi failed ({}): {}", o.status, said.trim()))
        }
    })
}

/// The numbers of the `nvidiaN` device nodes in `dev` (not `nvidiactl`, `nvidia-uvm`...), sorted.
pub fn nvidia_devices(dev: &Path) -> Vec<u32> {
    let mut out: Vec<u32> = std::fs::read_dir(dev)
        .map(|rd| {
            rd.flatten().filter_map(|e| e.file_name().to_str()?.strip_prefix("nvidia")?.parse::<u32>().ok()).collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out
}
