//! Panics contained: a panic in reading specs becomes that read's error ([`catch`]), and a mutex
//! whose holder panicked is still used ([`lock`]), so that no panic reaches the agent's loop.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Lock a mutex whose holder may have panicked: the data it guards is still usable (a source
/// handle, counters), so a panic elsewhere never turns into a second one here.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Run `f`, turning a panic into an error that carries the panic's message.
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        format!("{msg} (a bug in specd; please report it)")
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_panic_becomes_an_error_with_its_message_and_a_lock_survives_it() {
        let m = Arc::new(Mutex::new(1u32));
        let m2 = m.clone();
        let e = catch(move || {
            let _g = m2.lock().unwrap();
            panic!("num_steps + 1 overflowed");
        })
        .unwrap_err();
        assert!(e.contains("num_steps + 1 overflowed"), "{e}");
        assert!(e.contains("a bug in specd"), "{e}");
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
        assert_eq!(catch(|| 7), Ok(7));
        let e = catch(|| std::panic::panic_any(3u8)).unwrap_err();
        assert!(e.starts_with("a panic without a message"), "{e}");
    }
}
