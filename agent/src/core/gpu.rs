//! The GPUs' memory before a start, pure: what `nvidia-smi --query-gpu=index,uuid,memory.used,
//! memory.total --format=csv,noheader,nounits` says, which of its GPUs a unit's
//! `CUDA_VISIBLE_DEVICES` names, and whether each has the memory free that the start will claim.
//!
//! A start over memory still held (the old instance's, whose CUDA contexts the driver frees a
//! moment after its processes are gone; another process's) runs out of it: vLLM refuses to start
//! when the free memory is under its share of the total, SGLang and llama.cpp die of a CUDA OOM
//! while loading. Such a failure would be taken for the spec's (rolled back, quarantined), so the
//! start waits for the memory, and is not made when it stays held: the host's fault, said so.

/// One GPU as `nvidia-smi` reports it. Memory in MiB; `None` where it says `N/A` (a GPU with
/// unified memory reports none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub used_mib: Option<u64>,
    pub total_mib: Option<u64>,
}

/// A GPU no process uses shows the driver's own few hundred MiB: free, when nothing says how
/// much a start claims, means at most this share of it in use.
pub const IDLE_SHARE: f64 = 0.05;

/// The lines of `nvidia-smi --query-gpu=index,uuid,memory.used,memory.total
/// --format=csv,noheader,nounits` (`0, GPU-2762b558-…, 21246, 23034`), or why they do not read.
pub fn parse(text: &str) -> Result<Vec<Gpu>, String> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let mib = |s: &str| match s {
            "N/A" | "[N/A]" => Ok(None),
            s => s.parse::<u64>().map(Some).map_err(|_| format!("not a number of MiB: {s:?} in {line:?}")),
        };
        let [index, uuid, used, total] = f.as_slice() else {
            return Err(format!("not `index, uuid, memory.used, memory.total`: {line:?}"));
        };
        out.push(Gpu {
            index: index.parse().map_err(|_| format!("not a GPU index: {index:?} in {line:?}"))?,
            uuid: uuid.to_string(),
            used_mib: mib(used)?,
            total_mib: mib(total)?,
        });
    }
    if out.is_empty() {
        return Err("nvidia-smi listed no GPU".into());
    }
    Ok(out)
}

/// What `CUDA_VISIBLE_DEVICES` names, as CUDA reads it: indices and GPU UUIDs (or a unique
/// prefix of one), up to the first entry that is neither (CUDA ignores it and all after it); a
/// MIG device's memory is not its GPU's, and is not asked. Indices are nvidia-smi's, which CUDA
/// follows on hosts of one GPU model (or with `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
pub fn named<'g>(value: &str, gpus: &'g [Gpu]) -> Result<Vec<&'g Gpu>, String> {
    let mut out: Vec<&Gpu> = Vec::new();
    for e in value.split(',').map(str::trim) {
        let found = if let Ok(i) = e.parse::<u32>() {
            gpus.iter().find(|g| g.index == i)
        } else if e.starts_with("GPU-") {
            let mut m = gpus.iter().filter(|g| g.uuid.starts_with(e));
            match (m.next(), m.next()) {
                (Some(g), None) => Some(g),
                _ => None,
            }
        } else if e.starts_with("MIG-") {
            continue;
        } else {
            break;
        };
        let g = found.ok_or_else(|| format!("CUDA_VISIBLE_DEVICES names GPU {e}, which nvidia-smi does not list"))?;
        if !out.iter().any(|o| o.index == g.index) {
            out.push(g);
        }
    }
    Ok(out)
}

/// Why a GPU does not have the memory free that a start claims (`share` of its total, the
/// spec's or its engine's `mem_fraction_static`; `None`: the engine does not say, and the GPU
/// must be idle, [`IDLE_SHARE`]), if it does not: in use more than `(1 − share) × total`.
pub fn held(g: &Gpu, share: Option<f64>) -> Option<String> {
    let (used, total) = (g.used_mib?, g.total_mib?);
    let most = match share {
        Some(s) => (1.0 - s.clamp(0.0, 1.0)) * total as f64,
        None => IDLE_SHARE * total as f64,
    };
    (used as f64 > most).then(|| {
        let claim = match share {
            Some(s) => format!("the start claims {s} of it"),
            None => format!("idle is at most {:.0} %", IDLE_SHARE * 100.0),
        };
        format!("GPU {} ({}): {used} of {total} MiB in use ({claim})", g.index, g.uuid)
    })
}

/// What a look at the GPUs' memory before a start decides.
#[derive(Clone, Debug, PartialEq)]
pub enum Look {
    /// Start: the named GPUs have what the start claims (or the unit names none nvidia-smi lists
    /// memory for).
    Free,
    /// Look again: these GPUs' memory is held (each said as [`held`] says it).
    Held(Vec<String>),
    /// Do not start: the memory the start claims stayed held until the bound (the host's fault;
    /// the start would run out of it).
    Refuse(String),
    /// Start, and warn: memory could not be checked (nvidia-smi failed, or does not list a named
    /// GPU), or an engine that does not say how much it claims found the GPUs still in use.
    Warn(String),
}

/// The decision of one look: `answer` is what nvidia-smi said (or why it could not be asked),
/// `cvd` the unit's `CUDA_VISIBLE_DEVICES`, `share` what the start claims of each GPU (see
/// [`held`]), `last` whether the wait's bound (`within_s` seconds) has passed.
pub fn look(answer: Result<&str, &str>, cvd: &str, share: Option<f64>, last: bool, within_s: u64) -> Look {
    let read = answer.map_err(str::to_string).and_then(parse);
    let gpus = match read.as_deref().map_err(String::clone).and_then(|all| named(cvd, all)) {
        Ok(g) => g,
        Err(e) => return Look::Warn(format!("the GPUs' memory is not checked before the start: {e}")),
    };
    let held: Vec<String> = gpus.iter().filter_map(|g| held(g, share)).collect();
    match (held.is_empty(), last, share) {
        (true, ..) => Look::Free,
        (false, false, _) => Look::Held(held),
        (false, true, Some(_)) => Look::Refuse(format!(
            "the GPUs CUDA_VISIBLE_DEVICES names did not free their memory within {within_s}s: {}; not started over memory still held (the start would run out of it)",
            held.join("; ")
        )),
        (false, true, None) => Look::Warn(format!(
            "the GPUs CUDA_VISIBLE_DEVICES names are still in use after {within_s}s: {}; started anyway (its engine does not say how much memory it claims)",
            held.join("; ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recorded outputs (`agent/tests/fixtures/nvidia-smi/`, see its README).
    fn fixture(name: &str) -> &'static str {
        match name {
            "held.csv" => include_str!("../../tests/fixtures/nvidia-smi/held.csv"),
            "freed.csv" => include_str!("../../tests/fixtures/nvidia-smi/freed.csv"),
            "unified-memory.csv" => include_str!("../../tests/fixtures/nvidia-smi/unified-memory.csv"),
            "no-driver.txt" => include_str!("../../tests/fixtures/nvidia-smi/no-driver.txt"),
            _ => panic!("no fixture {name}"),
        }
    }

    #[test]
    fn the_recorded_outputs_read_as_their_gpus() {
        let held = parse(fixture("held.csv")).unwrap();
        assert_eq!(held.len(), 3);
        assert_eq!(
            held[0],
            Gpu {
                index: 0,
                uuid: "GPU-2762b558-7fac-024b-2b6f-209a2e06b94c".into(),
                used_mib: Some(21246),
                total_mib: Some(23034)
            }
        );
        assert_eq!((held[2].index, held[2].used_mib), (2, Some(0)));
        let unified = parse(fixture("unified-memory.csv")).unwrap();
        assert_eq!((unified[0].used_mib, unified[0].total_mib), (None, None));
        let e = parse(fixture("no-driver.txt")).unwrap_err();
        assert!(e.contains("NVIDIA-SMI has failed"), "{e}");
        assert_eq!(parse("").unwrap_err(), "nvidia-smi listed no GPU");
    }

    #[test]
    fn cuda_visible_devices_names_gpus_by_index_or_uuid_as_cuda_reads_it() {
        let gpus = parse(fixture("held.csv")).unwrap();
        let ids = |v: &str| named(v, &gpus).map(|g| g.iter().map(|g| g.index).collect::<Vec<_>>());
        assert_eq!(ids("0,1"), Ok(vec![0, 1]));
        assert_eq!(ids("GPU-e3386481, 0"), Ok(vec![2, 0]), "a unique prefix of a UUID");
        assert_eq!(ids("GPU-"), Err("CUDA_VISIBLE_DEVICES names GPU GPU-, which nvidia-smi does not list".into()));
        assert_eq!(ids("1,x,0"), Ok(vec![1]), "CUDA ignores an entry it cannot read and all after it");
        assert_eq!(ids("MIG-abc,2"), Ok(vec![2]));
        assert!(ids("7").unwrap_err().contains("GPU 7"));
    }

    #[test]
    fn a_look_decides_start_wait_refuse_or_warn() {
        let (held, freed) = (fixture("held.csv"), fixture("freed.csv"));
        let bad_driver = fixture("no-driver.txt");
        let one = "GPU 0 (GPU-2762b558-7fac-024b-2b6f-209a2e06b94c): 21246 of 23034 MiB in use";
        type Case<'a> = (Result<&'a str, &'a str>, &'a str, Option<f64>, bool, Look);
        let cases: &[Case] = &[
            (Ok(freed), "0,1", Some(0.92), false, Look::Free),
            (Ok(freed), "0,1", None, true, Look::Free),
            (Ok(held), "2", Some(0.92), false, Look::Free),
            (Ok(held), "0", Some(0.05), true, Look::Free),
            (Ok(held), "0", Some(0.92), false, Look::Held(vec![format!("{one} (the start claims 0.92 of it)")])),
            (
                Ok(held),
                "0,2",
                Some(0.92),
                true,
                Look::Refuse(format!(
                    "the GPUs CUDA_VISIBLE_DEVICES names did not free their memory within 30s: {one} (the start claims 0.92 of it); not started over memory still held (the start would run out of it)"
                )),
            ),
            (Ok(held), "0", None, false, Look::Held(vec![format!("{one} (idle is at most 5 %)")])),
            (
                Ok(held),
                "0",
                None,
                true,
                Look::Warn(format!(
                    "the GPUs CUDA_VISIBLE_DEVICES names are still in use after 30s: {one} (idle is at most 5 %); started anyway (its engine does not say how much memory it claims)"
                )),
            ),
            (Ok(fixture("unified-memory.csv")), "0", None, true, Look::Free),
            (
                Ok(held),
                "7",
                Some(0.92),
                false,
                Look::Warn(
                    "the GPUs' memory is not checked before the start: CUDA_VISIBLE_DEVICES names GPU 7, which nvidia-smi does not list".into(),
                ),
            ),
            (
                Err("nvidia-smi failed (exit status: 9): NVIDIA-SMI has failed"),
                "0",
                Some(0.92),
                false,
                Look::Warn("the GPUs' memory is not checked before the start: nvidia-smi failed (exit status: 9): NVIDIA-SMI has failed".into()),
            ),
        ];
        for (answer, cvd, share, last, want) in cases {
            assert_eq!(&look(*answer, cvd, *share, *last, 30), want, "{cvd} {share:?} last {last}");
        }
        assert!(
            matches!(look(Ok(bad_driver), "0", None, false, 30), Look::Warn(w) if w.contains("NVIDIA-SMI has failed"))
        );
    }

    #[test]
    fn a_gpu_is_free_for_a_start_when_what_it_claims_is_not_in_use() {
        let gpus = parse(fixture("held.csv")).unwrap();
        // 21246 of 23034 MiB in use: vLLM's default 0.92 does not fit, nor an idle GPU's bar.
        assert_eq!(
            held(&gpus[0], Some(0.92)).unwrap(),
            "GPU 0 (GPU-2762b558-7fac-024b-2b6f-209a2e06b94c): 21246 of 23034 MiB in use (the start claims 0.92 of it)"
        );
        assert!(held(&gpus[0], None).unwrap().ends_with("(idle is at most 5 %)"));
        assert!(held(&gpus[0], Some(0.05)).is_none(), "a start that claims 5 % fits beside it");
        assert!(held(&gpus[2], Some(0.92)).is_none() && held(&gpus[2], None).is_none());
        let freed = parse(fixture("freed.csv")).unwrap();
        assert!(freed.iter().all(|g| held(g, Some(0.92)).is_none()), "{freed:?}");
        // A GPU that reports no memory is not waited for.
        let unified = parse(fixture("unified-memory.csv")).unwrap();
        assert!(held(&unified[0], None).is_none());
    }
}
