//! Fleet rollouts: the promoter's decision (`rollout`, pure), its evidence from Prometheus
//! (`evidence`), the promotion record's commits (`publish`) and the commands that drive them
//! (`promote`: `specd promote`, `specd fleet status|halt|resume`) and what `fleet status` prints
//! (`status`: by wave, a host's units when named).
//!
//! It may not act on a host: a host acts on the record through its own agent (`crate::source::follow`).

pub mod evidence;
pub mod prometheus;
pub mod promote;
pub mod publish;
pub mod rollout;
pub mod status;
pub mod wake;

/// `f` of each of `items`, at most `n` at a time (a fan-out of questions or wake-ups); the outputs
/// in the items' order, `None` for a task that panicked.
pub(crate) async fn at_most<T, O, F, Fut>(n: usize, items: Vec<T>, f: F) -> Vec<Option<O>>
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = O> + Send + 'static,
    O: Send + 'static,
{
    let mut out: Vec<Option<O>> = (0..items.len()).map(|_| None).collect();
    let mut set = tokio::task::JoinSet::new();
    let mut pending = items.into_iter().enumerate();
    loop {
        while set.len() < n {
            let Some((i, t)) = pending.next() else { break };
            let fut = f(t);
            set.spawn(async move { (i, fut.await) });
        }
        let Some(done) = set.join_next().await else { break };
        if let Ok((i, o)) = done {
            out[i] = Some(o);
        }
    }
    out
}
