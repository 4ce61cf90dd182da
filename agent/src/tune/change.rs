//! The recommended change as an edit of the spec file: `speculative.num_steps` set to the new
//! length where it stands (the rest of the file byte for byte, as `specd sweep --write` does),
//! and the engine's derived fields with it (SGLang's draft tokens). The edit is the sweep's:
//! the new length is a one-point sweep of the file, validated and rendered like any point, and
//! the edited file must render that point's unit.

use specd_spec::sweep;

/// `text` (the spec file `file`) with `speculative.num_steps` = `k`, for `host`'s overlay.
pub fn changed(file: &str, text: &str, host: Option<&str>, k: u32) -> Result<String, String> {
    let base = specd_spec::parse(file, text).map_err(|d| d.to_string())?;
    let quoted = serde_json::to_string(file).expect("a string serializes");
    let host_line =
        host.map(|h| format!("  host: {}\n", serde_json::to_string(h).expect("a string"))).unwrap_or_default();
    let one = format!(
        "apiVersion: specd/v1\nkind: Sweep\nmetadata: {{name: tune}}\nspec:\n  base: {quoted}\n{host_line}  matrix: {{speculative.num_steps: [{k}]}}\n  load: {{concurrency: [1], requests: 1}}\n"
    );
    let parsed = sweep::parse_sweep(&one, "the change").map_err(|d| d.to_string())?;
    let points = sweep::points(&parsed, &base).map_err(|d| d.to_string())?;
    let point = points.first().ok_or("no point")?;
    crate::sweep::edit_spec(&base, text, point, host)
}

/// A unified diff of the change, headed by the file's name.
pub fn diff(name: &str, old: &str, new: &str) -> String {
    similar::TextDiff::from_lines(old, new).unified_diff().header(name, name).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = "apiVersion: specd/v1
kind: InferenceService
metadata: {name: v}
spec:
  unit: v.service
  engine: vllm
  model: /m
  speculative:
    algorithm: ngram
    num_steps: 6   # the running length
    prompt_lookup_max: 3
";

    #[test]
    fn the_length_is_set_where_it_stands_and_the_rest_kept() {
        let new = changed("v.yaml", VLLM, None, 3).unwrap();
        assert_eq!(new, VLLM.replace("num_steps: 6   #", "num_steps: 3   #"));
        let d = diff("v.yaml", VLLM, &new);
        assert!(
            d.contains("-    num_steps: 6   # the running length\n+    num_steps: 3   # the running length"),
            "{d}"
        );
    }

    #[test]
    fn sglangs_draft_tokens_move_with_the_steps_and_a_bad_length_is_refused() {
        let sglang = "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: s}\nspec:\n  unit: s.service\n  engine: sglang\n  model: /m\n  speculative: {algorithm: EAGLE, draft_model: /d, num_steps: 4, eagle_topk: 1, num_draft_tokens: 5}\n";
        let new = changed("s.yaml", sglang, None, 2).unwrap();
        assert!(new.contains("num_steps: 2, eagle_topk: 1, num_draft_tokens: 3}"), "{new}");
        let why = changed("v.yaml", VLLM, None, 0).unwrap_err();
        assert!(why.contains("num_steps"), "{why}");
    }
}
