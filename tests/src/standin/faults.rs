//! Injected faults: a CUDA out-of-memory death as each engine dies of it, a
//! real host-memory hog, a child that outlives SIGTERM.

use std::sync::atomic::{AtomicBool, Ordering};

use super::args::{Flavour, Knobs, Launch};
use super::logs::line;

const TORCH_OOM: &str = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use. Of the allocated memory 76.80 GiB is allocated by PyTorch, and 412.33 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)";

const PY: &str = "/usr/local/lib/python3.12/dist-packages";
/// vLLM's site-packages, as in the real recordings.
const VLLM_PY: &str = "/opt/vllm/lib/python3.11/site-packages";

/// Dies of a CUDA OOM during model load, the way the engine does. Returns
/// the exit code where the engine exits (vLLM, llama.cpp); SGLang kills its
/// own process tree with SIGKILL.
pub fn cuda_oom(l: &Launch) -> i32 {
    match l.flavour {
        Flavour::Sglang => {
            let tb = format!(
                "Scheduler hit an exception: Traceback (most recent call last):\n  File \"{PY}/sglang/srt/managers/scheduler.py\", line 3150, in run_scheduler_process\n    scheduler = Scheduler(\n  File \"{PY}/sglang/srt/managers/scheduler.py\", line 402, in __init__\n    self.init_model_worker()\n  File \"{PY}/sglang/srt/model_executor/model_runner.py\", line 905, in load_model\n    self.model = get_model(\n  File \"{PY}/sglang/srt/model_loader/loader.py\", line 612, in load_model\n    model = _initialize_model(\n  File \"{PY}/torch/nn/modules/module.py\", line 1355, in to\n    return self._apply(convert)\n  File \"{PY}/torch/nn/modules/module.py\", line 1341, in convert\n    return t.to(\n{TORCH_OOM}\n"
            );
            for l2 in tb.lines() {
                eprintln!("{l2}");
            }
            line(l.flavour, "error", "SIGQUIT received. signum=None, frame=None. It usually means one child failed.");
            line(
                l.flavour,
                "info",
                &format!("kill_process_tree called: parent_pid={0}, include_parent=True, pid={0}", std::process::id()),
            );
            // SAFETY: kill(2) on ourselves, as SGLang's kill_process_tree does.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            137
        }
        Flavour::Vllm => {
            // The engine core logs its traceback (each line under its header); the API server
            // then raises its own, unlogged.
            let core = format!(
                "EngineCore failed to start.\nTraceback (most recent call last):\n  File \"{VLLM_PY}/vllm/v1/engine/core.py\", line 1482, in run_engine_core\n    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)\n                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n  File \"{VLLM_PY}/vllm/v1/worker/gpu_model_runner.py\", line 5057, in load_model\n    self.model = model or model_loader.load_model(\n                          ^^^^^^^^^^^^^^^^^^^^^^^^^\n{TORCH_OOM}"
            );
            super::logs::vllm_log("EngineCore", "error", "core.py:1510", &core);
            eprintln!(
                "{}  File \"{VLLM_PY}/vllm/v1/engine/utils.py\", line 1351, in launch_core_engines\n    wait_for_engine_startup(\n  File \"{VLLM_PY}/vllm/v1/engine/utils.py\", line 1432, in wait_for_engine_startup\n    raise RuntimeError(\nRuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{'EngineCore': 1}}",
                super::vllm::TB_HEAD
            );
            1
        }
        Flavour::LlamaCpp => {
            eprintln!(
                "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 20480.00 MiB on device 0: cudaMalloc failed: out of memory"
            );
            eprintln!("alloc_tensor_range: failed to allocate CUDA0 buffer of size 21474836480");
            eprintln!("llama_model_load: error loading model: unable to allocate CUDA0 buffer");
            eprintln!("llama_model_load_from_file_impl: failed to load model");
            eprintln!(
                "srv    load_model: failed to load model, '{}'",
                l.args["model_path"].as_str().unwrap_or_default()
            );
            eprintln!("main: exiting due to model loading error");
            1
        }
    }
}

/// This process's memory limit (cgroup v2 `memory.max` or v1
/// `memory.limit_in_bytes`), if it has one.
fn memory_limit() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for l in cg.lines() {
        let mut p = l.splitn(3, ':');
        let (_, ctrl, path) = (p.next()?, p.next()?, p.next()?);
        let f = if ctrl.is_empty() {
            format!("/sys/fs/cgroup{path}/memory.max")
        } else if ctrl.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        } else {
            continue;
        };
        if let Some(n) = std::fs::read_to_string(&f).ok().and_then(|s| s.trim().parse::<u64>().ok())
            && n < (1 << 50)
        {
            return Some(n);
        }
    }
    None
}

/// Loads "weights" into host memory until the cgroup's limit kills it. To
/// protect a machine without a limit it stops at 1 GiB and then holds.
pub fn memory_hog(l: &Launch) {
    let limit = memory_limit();
    let cap = match limit {
        Some(n) => n.saturating_mul(2),
        None => 1 << 30,
    };
    line(l.flavour, "info", &format!("Loading safetensors checkpoint shards (memory limit: {limit:?})"));
    let mut held: Vec<Vec<u8>> = Vec::new();
    let chunk = 16 << 20;
    let mut total: u64 = 0;
    while total < cap {
        let mut v = vec![0u8; chunk];
        for i in (0..chunk).step_by(4096) {
            v[i] = 1; // touch every page
        }
        held.push(v);
        total += chunk as u64;
        if total.is_multiple_of(256 << 20) {
            line(l.flavour, "info", &format!("Loading weights: {} MiB", total >> 20));
        }
    }
    line(l.flavour, "warning", "memory hog reached its cap without being killed; holding");
    loop {
        std::thread::park();
        std::hint::black_box(&held);
    }
}

/// The lingering child: ignores SIGTERM and waits forever.
pub fn linger() -> ! {
    // SAFETY: setting a signal disposition to SIG_IGN.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
    loop {
        // SAFETY: pause(2) has no preconditions.
        unsafe { libc::pause() };
    }
}

static ARMED: AtomicBool = AtomicBool::new(false);
static ANSWERED_READY: AtomicBool = AtomicBool::new(false);

/// At startup: `crash-after-ready` applies to an instance started while its file exists (not to
/// one that already ran).
pub fn arm(k: &Knobs) {
    if k.crash_after_ready.as_deref().is_some_and(|p| std::path::Path::new(p).exists()) {
        ARMED.store(true, Ordering::SeqCst);
    }
}

/// `/health` answered 200: an armed instance dies at the next request.
pub fn answered_ready() {
    if ARMED.load(Ordering::SeqCst) {
        ANSWERED_READY.store(true, Ordering::SeqCst);
    }
}

/// The crash after readiness: SIGKILL, as a segfault or the OOM killer would end it. The file is
/// removed first, so one crash is injected per file (the instance systemd restarts runs on).
pub fn crash_if_answered_ready(k: &Knobs) {
    if ANSWERED_READY.load(Ordering::SeqCst) {
        if let Some(p) = &k.crash_after_ready {
            let _ = std::fs::remove_file(p);
        }
        eprintln!("specd-standin: crashing right after readiness as asked (SPECD_STANDIN_CRASH_AFTER_READY)");
        // SAFETY: kill(2) on ourselves.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
