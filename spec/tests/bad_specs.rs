//! Table-driven: each bad spec gets a clear error naming the file, line, field path and problem.

const BASE: &str = "apiVersion: specd/v1
kind: InferenceService
metadata:
  name: t
spec:
  unit: t.service
  engine: sglang
  model: /m
";

/// (case, yaml appended to BASE (or a whole document when it starts with `apiVersion`),
///  expected line, expected field path, expected message fragment)
const CASES: &[(&str, &str, u64, &str, &str)] = &[
    ("yaml syntax", "  server: [\n", 9, "", "expected"),
    ("wrong type", "  server:\n    port: abc\n", 10, "spec.server.port", "expected an integer, got a string: \"abc\""),
    ("unknown field", "  server:\n    portt: 5\n", 10, "spec.server.portt", "unknown field `portt`"),
    ("duplicate key", "  model: /n\n", 9, "spec.model", "duplicate key `model`"),
    (
        "unknown engine",
        "  speculative: {}\nhosts:\n  h1:\n    engine: tgi\n",
        12,
        "hosts.h1.engine",
        "unknown variant `tgi`",
    ),
    (
        "unknown weights check",
        "  weights: {verify: md5}\n",
        9,
        "spec.weights.verify",
        "unknown variant `md5`, expected one of none, sha256",
    ),
    ("wrong apiVersion", "#\n", 1, "apiVersion", "must be `specd/v1`"),
    ("bad name", "#\n", 4, "metadata.name", "lowercase letters"),
    ("unit path traversal", "#\n", 6, "spec.unit", "no `/` and no `..`"),
    ("unit with slash", "#\n", 6, "spec.unit", "not a valid service name"),
    ("unit not a service", "#\n", 6, "spec.unit", "ending in `.service`"),
    ("relative model", "#\n", 8, "spec.model", "must be an absolute path"),
    ("newline in model", "#\n", 8, "spec.model", "control character '\\n'"),
    ("NUL in model", "#\n", 8, "spec.model", "control character '\\0'"),
    (
        "sglang speculative without algorithm",
        "  speculative: {num_steps: 4}\n",
        9,
        "spec.speculative.algorithm",
        "is required: SGLang speculates only with --speculative-algorithm (EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM)",
    ),
    ("port too large", "  server: {port: 70000}\n", 9, "spec.server.port", "1..=65535"),
    ("port zero", "  server: {port: 0}\n", 9, "spec.server.port", "1..=65535"),
    (
        "rollout max_unavailable zero",
        "  rollout: {group: llm, max_unavailable: 0}\n",
        9,
        "spec.rollout.max_unavailable",
        "at least 1",
    ),
    (
        "rollout without group",
        "  rollout:\n    max_unavailable: 2\n",
        9,
        "spec.rollout.group",
        "is required with `rollout:`",
    ),
    ("rollout group not a name", "  rollout: {group: LLM_a}\n", 9, "spec.rollout.group", "lowercase letters"),
    (
        "rollout max_unavailable a string",
        "  rollout: {group: llm, max_unavailable: one}\n",
        9,
        "spec.rollout.max_unavailable",
        "expected an integer",
    ),
    ("rollout unknown field", "  rollout: {group: llm, surge: 1}\n", 9, "spec.rollout.surge", "unknown field `surge`"),
    (
        "rollout max_unavailable zero without surge",
        "  rollout: {group: llm, max_unavailable: 0, max_surge: 0}\n",
        9,
        "spec.rollout.max_unavailable",
        "or 0 with `max_surge` at least 1",
    ),
    (
        "rollout max_surge too large",
        "  rollout: {group: llm, max_surge: 9}\n",
        9,
        "spec.rollout.max_surge",
        "at most 8",
    ),
    ("rollout spare not a bool", "  rollout: {group: llm, spare: yes}\n", 9, "spec.rollout.spare", "true or false"),
    ("mem fraction > 1", "  server: {mem_fraction_static: 1.5}\n", 9, "spec.server.mem_fraction_static", "(0, 1]"),
    (
        "sglang topk 1 draft tokens",
        "  server: {max_running_requests: 16}\n  speculative:\n    algorithm: NEXTN\n    num_steps: 10\n    eagle_topk: 1\n    num_draft_tokens: 7\n",
        14,
        "spec.speculative.num_draft_tokens",
        "num_draft_tokens must be num_steps + 1 = 11 when eagle_topk is 1, got 7; SGLang would silently reset it",
    ),
    (
        "sglang topk without steps",
        "  speculative:\n    algorithm: NEXTN\n    eagle_topk: 1\n",
        11,
        "spec.speculative.eagle_topk",
        "SGLang asserts",
    ),
    (
        "sglang lowercase algorithm",
        "  speculative: {algorithm: nextn}\n",
        9,
        "spec.speculative.algorithm",
        "did you mean NEXTN?",
    ),
    (
        "sglang ngram with topk",
        "  speculative: {algorithm: NGRAM, eagle_topk: 4}\n",
        9,
        "spec.speculative.eagle_topk",
        "NGRAM: SGLang overwrites it",
    ),
    (
        "sglang ngram with steps",
        "  speculative: {algorithm: NGRAM, num_steps: 4}\n",
        9,
        "spec.speculative.num_steps",
        "derives it",
    ),
    (
        "sglang eagle without draft model",
        "  speculative: {algorithm: EAGLE3, num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}\n",
        9,
        "spec.speculative.draft_model",
        "is required by EAGLE3",
    ),
    (
        "vllm without num tokens",
        "  speculative: {algorithm: ngram}\n",
        9,
        "spec.speculative.num_steps",
        "num_speculative_tokens must be provided",
    ),
    (
        "vllm unknown method",
        // As a real vLLM 0.32 was given it (tests/fixtures/engines/vllm/real/start-unknown-method.log).
        "  speculative: {algorithm: foo, num_steps: 4}\n",
        9,
        "spec.speculative.algorithm",
        "not a vLLM speculative method",
    ),
    (
        // vLLM: `Input should be greater than 0 [type=greater_than, input_value=-1 …]`.
        "vllm negative num_speculative_tokens",
        "  speculative: {algorithm: ngram, num_steps: -1}\n",
        9,
        "spec.speculative.num_steps",
        "",
    ),
    (
        // vLLM: prompt_lookup_min and _max are `Field(ge=1)`.
        "vllm prompt_lookup_min 0",
        "  speculative: {algorithm: ngram, num_steps: 4, prompt_lookup_min: 0}\n",
        9,
        "spec.speculative.prompt_lookup_min",
        "must be at least 1",
    ),
    (
        "vllm topk",
        "  speculative: {algorithm: mtp, num_steps: 2, eagle_topk: 2}\n",
        9,
        "spec.speculative.eagle_topk",
        "not a vLLM option",
    ),
    (
        "vllm lookup min > max",
        "  speculative: {algorithm: ngram, num_steps: 2, prompt_lookup_min: 5, prompt_lookup_max: 3}\n",
        9,
        "spec.speculative.prompt_lookup_min",
        "at most prompt_lookup_max (3)",
    ),
    (
        "llama removed --draft-max",
        "  server:\n    extra_args: [--draft-max, \"8\"]\n",
        10,
        "spec.server.extra_args[0]",
        "was removed from llama-cpp",
    ),
    (
        "llama steps without draft",
        "  speculative: {num_steps: 8}\n",
        9,
        "spec.speculative.draft_model",
        "--spec-draft-model",
    ),
    (
        "llama algorithm",
        "  speculative: {algorithm: EAGLE, draft_model: /d}\n",
        9,
        "spec.speculative.algorithm",
        "\"EAGLE\" is not a llama-server --spec-type; use one of draft-simple, draft-eagle3",
    ),
    (
        "llama spec-type none",
        "  speculative: {algorithm: none, draft_model: /d}\n",
        9,
        "spec.speculative.algorithm",
        "to turn speculation off, remove the speculative section",
    ),
    (
        "llama draft type without draft model",
        "  speculative: {algorithm: draft-eagle3}\n",
        9,
        "spec.speculative.draft_model",
        "is required by --spec-type draft-eagle3",
    ),
    (
        "llama ngram type with a draft model",
        "  speculative: {algorithm: ngram-mod, draft_model: /d}\n",
        9,
        "spec.speculative.draft_model",
        "is not used by --spec-type ngram-mod",
    ),
    (
        "llama --spec-type in extra_args",
        "  server:\n    extra_args: [--spec-type, draft-simple]\n",
        10,
        "spec.server.extra_args[0]",
        "speculative.algorithm",
    ),
    (
        "extra_args repeats tp",
        "  server:\n    extra_args: [--enable-metrics, --tp-size, \"2\"]\n",
        10,
        "spec.server.extra_args[1]",
        "from `spec.server.tp_size`",
    ),
    (
        "extra_args abbreviates an owned flag",
        "  server:\n    extra_args: [--mem-fraction, \"0.5\"]\n",
        10,
        "spec.server.extra_args[0]",
        "abbreviates `--mem-fraction-static`",
    ),
    (
        "extra_args --config",
        "  server:\n    extra_args: [--config, /etc/x.yaml]\n",
        10,
        "spec.server.extra_args[0]",
        "`--config` would let a file override",
    ),
    (
        "backslash ends the description",
        "  service: {description: 'x\\'}\n",
        9,
        "spec.service.description",
        "may not contain a backslash",
    ),
    (
        "extra_args repeats port with =",
        "  server:\n    extra_args: [--port=9]\n",
        10,
        "spec.server.extra_args[0]",
        "`--port` is rendered by specd",
    ),
    (
        "newline in extra_args",
        "  server:\n    extra_args: [\"--x\\nExecStartPre=/bin/rm -rf /\"]\n",
        10,
        "spec.server.extra_args[0]",
        "control character",
    ),
    (
        "newline in env value",
        "  service:\n    environment: {A: \"x\\n[Service]\"}\n",
        10,
        "spec.service.environment.A",
        "inject a line",
    ),
    (
        "NUL in env value",
        "  service:\n    environment: {A: \"x\\0\"}\n",
        10,
        "spec.service.environment.A",
        "control character",
    ),
    (
        "bad env key",
        "  service:\n    environment: {A-B: x}\n",
        10,
        "spec.service.environment.A-B",
        "not a valid environment variable name",
    ),
    (
        "relative working dir",
        "  service: {working_directory: opt}\n",
        9,
        "spec.service.working_directory",
        "absolute path",
    ),
    (
        "bad user",
        "  service: {user: \"a b\"}\n",
        9,
        "spec.service.user",
        "is not a valid user: \"a b\" is not a valid name",
    ),
    ("bad memory_max", "  service: {memory_max: lots}\n", 9, "spec.service.memory_max", "not a memory size"),
    ("zero stop timeout", "  service: {timeout_stop_sec: 0}\n", 9, "spec.service.timeout_stop_sec", "at least 1"),
    ("endpoint without slash", "  readiness: {endpoint: health}\n", 9, "spec.readiness.endpoint", "starting with `/`"),
    (
        "overlay changes unit",
        "hosts:\n  gpu-02:\n    unit: other.service\n",
        11,
        "hosts.gpu-02.unit",
        "may not change the unit",
    ),
    (
        "overlay breaks a rule",
        "  server: {max_running_requests: 16}\n  speculative: {algorithm: NEXTN, num_steps: 10, eagle_topk: 1, num_draft_tokens: 11}\nhosts:\n  gpu-02:\n    speculative: {num_steps: 5}\n",
        13,
        "hosts.gpu-02.speculative.num_steps",
        "num_draft_tokens must be num_steps + 1 = 6 when eagle_topk is 1, got 11; SGLang would silently reset it to 6, which would later look like drift",
    ),
    (
        "relative command",
        "  command: [bin/python3, -m, x]\n",
        9,
        "spec.command[0]",
        "absolute path or a bare program name",
    ),
    (
        "command with option prefix",
        "  command: [\"-/bin/true\"]\n",
        9,
        "spec.command[0]",
        "absolute path or a bare program name",
    ),
    ("n_gpu_layers on sglang", "  server: {n_gpu_layers: 10}\n", 9, "spec.server.n_gpu_layers", "llama-cpp option"),
    ("tp_size on llama", "  server: {tp_size: 2}\n", 9, "spec.server.tp_size", "not an option of llama-cpp"),
    ("missing engine", "#\n", 5, "spec.engine", "is required"),
    // Numbers: exactly what YAML says, range-checked, never coerced from strings.
    (
        "num_steps at u32::MAX",
        "  server: {max_running_requests: 16}\n  speculative: {algorithm: NEXTN, num_steps: 4294967295, eagle_topk: 1, num_draft_tokens: 11}\n",
        10,
        "spec.speculative.num_draft_tokens",
        "num_draft_tokens must be num_steps + 1 = 4294967296 when eagle_topk is 1, got 11",
    ),
    (
        "quoted hex port",
        "  server: {port: \"0x1F90\"}\n",
        9,
        "spec.server.port",
        "expected an integer, got a string: \"0x1F90\"",
    ),
    (
        "quoted underscored tp",
        "  server: {tp_size: \"1_0\"}\n",
        9,
        "spec.server.tp_size",
        "expected an integer, got a string: \"1_0\"",
    ),
    (
        "plain underscored tp",
        "  server: {tp_size: 1_0}\n",
        9,
        "spec.server.tp_size",
        "expected an integer, got a string: \"1_0\"",
    ),
    (
        "quoted port",
        "  server:\n    port: '8080'\n",
        10,
        "spec.server.port",
        "expected an integer, got a string: \"8080\"",
    ),
    ("negative port", "  server: {port: -1}\n", 9, "spec.server.port", "expected an integer in 0..=4294967295, got -1"),
    (
        "number beyond u32",
        "  service: {restart_sec: 4294967296}\n",
        9,
        "spec.service.restart_sec",
        "expected an integer in 0..=4294967295, got 4294967296",
    ),
    (
        "number beyond u64",
        "  service: {timeout_stop_sec: 99999999999999999999999}\n",
        9,
        "spec.service.timeout_stop_sec",
        "expected an integer in 0..=4294967295, got 100000000000000000000000, which is out of range",
    ),
    (
        "float for an integer",
        "  server: {tp_size: 2.5}\n",
        9,
        "spec.server.tp_size",
        "expected an integer, got the floating-point number 2.5",
    ),
    (
        "exponent for an integer",
        "  server: {port: 1e3}\n",
        9,
        "spec.server.port",
        "expected an integer, got the floating-point number 1000",
    ),
    (
        "quoted float",
        "  server: {mem_fraction_static: \"0.5\"}\n",
        9,
        "spec.server.mem_fraction_static",
        "expected a number, got a string: \"0.5\"",
    ),
    (
        "NaN fraction",
        "  server: {mem_fraction_static: .nan}\n",
        9,
        "spec.server.mem_fraction_static",
        "must be in (0, 1], got NaN",
    ),
    (
        "yes is not a boolean",
        "  policy: {rollback: yes}\n",
        9,
        "spec.policy.rollback",
        "expected true or false, got a string: \"yes\"",
    ),
    (
        "quoted boolean",
        "  readiness: {verify_args: \"true\"}\n",
        9,
        "spec.readiness.verify_args",
        "expected true or false, got a string: \"true\"",
    ),
    // Duplicate keys name the repeated field itself.
    ("duplicate section", "  server: {port: 1}\n  server: {port: 2}\n", 10, "spec.server", "duplicate key `server`"),
    ("duplicate host", "hosts:\n  a: {model: /x}\n  a: {model: /y}\n", 11, "hosts.a", "duplicate key `a`"),
    // What systemd refuses or ignores.
    (
        "quote in the program path",
        "  command: [\"/opt/we\\\"ird/python3\"]\n",
        9,
        "spec.command[0]",
        "the program's path may not contain '\"'",
    ),
    (
        "apostrophe in the program path",
        "  command: [\"/opt/it's/python3\"]\n",
        9,
        "spec.command[0]",
        "may not contain '\\''",
    ),
    ("backslash in the program path", "  command: ['/opt/a\\b']\n", 9, "spec.command[0]", "may not contain '\\\\'"),
    ("dollar in the program path", "  command: ['/opt/$x/python3']\n", 9, "spec.command[0]", "does not expand `$`"),
    ("program path is a directory", "  command: [/opt/bin/]\n", 9, "spec.command[0]", "names a directory"),
    ("uid 65535", "  service: {user: \"65535\"}\n", 9, "spec.service.user", "not 65535"),
    ("uid 4294967295", "  service: {user: \"4294967295\"}\n", 9, "spec.service.user", "must be in 0..=4294967294"),
    ("uid beyond u32", "  service: {group: \"99999999999\"}\n", 9, "spec.service.group", "must be in 0..=4294967294"),
    ("uid with a leading zero", "  service: {user: \"0100\"}\n", 9, "spec.service.user", "may not have a leading zero"),
    ("dotted user", "  service: {user: first.last}\n", 9, "spec.service.user", "(systemd's strict rules: no dots)"),
    ("user too long", "  service: {user: abcdefghijklmnopqrstuvwxyz0123456}\n", 9, "spec.service.user", "at most 31"),
    ("memory_max 0", "  service: {memory_max: \"0\"}\n", 9, "spec.service.memory_max", "is zero"),
    ("memory_max 0%", "  service: {memory_max: 0%}\n", 9, "spec.service.memory_max", "is zero"),
    ("memory_max 101%", "  service: {memory_max: 101%}\n", 9, "spec.service.memory_max", "is more than 100%"),
    ("memory_max 12.345%", "  service: {memory_max: 12.345%}\n", 9, "spec.service.memory_max", "at most two decimals"),
    ("memory_max too large", "  service: {memory_max: 16E}\n", 9, "spec.service.memory_max", "too large"),
    ("memory_max two suffixes", "  service: {memory_max: 1GG}\n", 9, "spec.service.memory_max", "not a memory size"),
    // systemd takes these, and kills the server while it loads.
    (
        "memory_max one byte",
        "  service: {memory_max: \"1\"}\n",
        9,
        "spec.service.memory_max",
        "\"1\" is 1 byte: no sglang server starts in less than 1 GiB (its runtime alone needs that much memory, before any weights), and systemd would kill it while it loads, at every restart; give at least `1G`, a percentage of the host's memory, or `infinity`",
    ),
    (
        "memory_max 512M",
        "  service: {memory_max: 512M}\n",
        9,
        "spec.service.memory_max",
        "\"512M\" is 512 MiB: no sglang",
    ),
    ("memory_max 1023.5M", "  service: {memory_max: 1023.5M}\n", 9, "spec.service.memory_max", "is 1023.5 MiB: no"),
    (
        "vllm memory_max 64K",
        "  service: {memory_max: 64K}\n",
        9,
        "spec.service.memory_max",
        "is 64 KiB: no vllm server",
    ),
    (
        "llama memory_max 32M",
        "  service: {memory_max: 32M}\n",
        9,
        "spec.service.memory_max",
        "is 32 MiB: no llama-cpp server starts in less than 64 MiB",
    ),
    (
        "memory_max in an overlay",
        "hosts:\n  h1:\n    service: {memory_max: 100B}\n",
        11,
        "hosts.h1.service.memory_max",
        "\"100B\" is 100 bytes",
    ),
    ("huge model path", "#\n", 8, "spec.model", "is 1000001 bytes long; the limit is 4095 bytes"),
    ("long model path", "#\n", 8, "spec.model", "is 5001 bytes long; the limit is 4095 bytes"),
    ("long path component", "#\n", 8, "spec.model", "path component of 300 bytes; the limit is 255 bytes"),
    ("long served name", "#\n", 9, "spec.server.served_model_name", "is 300 bytes long; the limit is 255 bytes"),
    ("long extra arg", "#\n", 10, "spec.server.extra_args[0]", "is 5000 bytes long; the limit is 4096 bytes"),
    ("long command line", "#\n", 10, "spec.server.extra_args", "the command line would be"),
    // A spec may not take over the host's own units.
    ("journald", "#\n", 6, "spec.unit", "\"systemd-journald.service\" is reserved for systemd's own units"),
    ("dbus", "#\n", 6, "spec.unit", "is reserved for the D-Bus message bus"),
    ("specd itself", "#\n", 6, "spec.unit", "is reserved for specd's own unit"),
    ("sshd", "#\n", 6, "spec.unit", "reserved for remote access"),
    // Secrets stay out of the unit file.
    (
        "literal token",
        "  service:\n    environment: {HF_TOKEN: hf_abc}\n",
        10,
        "spec.service.environment.HF_TOKEN",
        "HF_TOKEN looks like a secret: a literal value here is readable by every local user in the unit file and specd's state. Put `HF_TOKEN=...` in a root-only file listed in service.environment_files, or pass the file as service.credentials",
    ),
    (
        "literal token without underscore",
        "  service:\n    environment: {GithubToken: x}\n",
        10,
        "spec.service.environment.GithubToken",
        "looks like a secret",
    ),
    (
        "literal api key",
        "  service:\n    environment: {openai_api_key: sk}\n",
        10,
        "spec.service.environment.openai_api_key",
        "looks like a secret",
    ),
    (
        "literal password",
        "  service:\n    environment: {DB_PASSWORD: x}\n",
        10,
        "spec.service.environment.DB_PASSWORD",
        "service.allow_literal_secrets: true",
    ),
    (
        "literal secret in an overlay",
        "hosts:\n  h1:\n    service: {environment: {MY_SECRET: x}}\n",
        11,
        "hosts.h1.service.environment.MY_SECRET",
        "looks like a secret",
    ),
    // Nor on the server's command line (the unit file and /proc/PID/cmdline).
    (
        "vllm api key in extra_args",
        "  server:\n    extra_args: [--api-key, sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t]\n",
        10,
        "spec.server.extra_args[0]",
        "`--api-key` takes a secret: a literal one here is readable by every local user, in the unit file (0644) and in the server's command line (`ps`, /proc/PID/cmdline). vLLM reads it from the environment variable VLLM_API_KEY: leave the flag out and put `VLLM_API_KEY=...` in a root-only file listed in service.environment_files; set service.allow_literal_secrets: true if it is not secret",
    ),
    (
        "sglang api key in extra_args",
        "  server:\n    extra_args: [--enable-metrics, \"--api-key=letmein\"]\n",
        10,
        "spec.server.extra_args[1]",
        "`--api-key` takes a secret: a literal one here is readable by every local user, in the unit file (0644) and in the server's command line (`ps`, /proc/PID/cmdline). SGLang takes it only on its command line",
    ),
    (
        "llama api key in extra_args",
        "  server:\n    extra_args: [--api-key, letmein]\n",
        10,
        "spec.server.extra_args[0]",
        "llama-server reads it from the environment variable LLAMA_API_KEY: leave the flag out and put `LLAMA_API_KEY=...` in a root-only file listed in service.environment_files, or pass the file as service.credentials (NAME: PATH) and give `--api-key-file /run/credentials/t.service/NAME`",
    ),
    (
        "llama hf token short flag",
        "  server:\n    extra_args: [-hft, abc]\n",
        10,
        "spec.server.extra_args[0]",
        "`-hft` takes a secret",
    ),
    (
        "a flag named for a secret",
        "  server:\n    extra_args: [--enable-metrics, --custom-auth-token, abc]\n",
        10,
        "spec.server.extra_args[1]",
        "`--custom-auth-token` takes a secret: a literal one here is readable by every local user, in the unit file (0644) and in the server's command line (`ps`, /proc/PID/cmdline). Give it to the server in a root-only file it reads (service.environment_files, service.credentials) instead",
    ),
    (
        "a token in a JSON argument",
        "  server:\n    extra_args: [--hf-overrides, '{\"token\": \"hf_AbCdEfGhIjKlMnOpQrStUvWxYzAbCdEfGh\"}']\n",
        10,
        "spec.server.extra_args[1]",
        "looks like a Hugging Face token (`hf_…`): a literal one here is readable by every local user",
    ),
    (
        "a secret set by env in the command",
        "  command: [/usr/bin/env, HF_TOKEN=abc, python3, -m, sglang.launch_server]\n",
        9,
        "spec.command[1]",
        "sets HF_TOKEN, which looks like a secret, on the command line",
    ),
    (
        "a key as the served model name",
        "  server: {served_model_name: sk-Ab3dEf6hIj9kLm2nOp5qRs8tUv}\n",
        9,
        "spec.server.served_model_name",
        "looks like an API key (`sk-…`)",
    ),
    (
        "an api key in an overlay's extra_args",
        "hosts:\n  h1:\n    server: {extra_args: [--api-key, x]}\n",
        11,
        "hosts.h1.server.extra_args[0]",
        "`--api-key` takes a secret",
    ),
    (
        "a token-shaped value under a plain name",
        "  service:\n    environment: {MY_CONF: hf_AbCdEfGhIjKlMnOpQrStUvWxYzAbCdEfGh}\n",
        10,
        "spec.service.environment.MY_CONF",
        "the value looks like a Hugging Face token (`hf_…`)",
    ),
    (
        "relative environment file",
        "  service: {environment_files: [env/x]}\n",
        9,
        "spec.service.environment_files[0]",
        "must be an absolute path",
    ),
    (
        "optional relative environment file",
        "  service: {environment_files: [-env/x]}\n",
        9,
        "spec.service.environment_files[0]",
        "must be an absolute path, got \"env/x\"",
    ),
    (
        "environment file with ..",
        "  service: {environment_files: [/etc/../x]}\n",
        9,
        "spec.service.environment_files[0]",
        "may not contain `..`",
    ),
    (
        "backslash in an environment file",
        "  service: {environment_files: ['/etc/x\\']}\n",
        9,
        "spec.service.environment_files[0]",
        "may not contain a backslash",
    ),
    (
        "credential name with a slash",
        "  service: {credentials: {a/b: /etc/x}}\n",
        9,
        "spec.service.credentials.a/b",
        "is not a credential name",
    ),
    (
        "credential name with a colon",
        "  service: {credentials: {\"a:b\": /etc/x}}\n",
        9,
        "spec.service.credentials.a:b",
        "is not a credential name",
    ),
    (
        "credential path not normal",
        "  service: {credentials: {tok: /etc//x}}\n",
        9,
        "spec.service.credentials.tok",
        "\"/etc//x\" is not in normal form",
    ),
    (
        "relative credential",
        "  service: {credentials: {tok: tok.txt}}\n",
        9,
        "spec.service.credentials.tok",
        "must be an absolute path",
    ),
    (
        "enabled as a quoted string",
        "  service: {enabled: \"false\"}\n",
        9,
        "spec.service.enabled",
        "expected true or false, got a string: \"false\"",
    ),
    (
        "drain_refuse_new as a word",
        "  service: {drain_refuse_new: yes}\n",
        9,
        "spec.service.drain_refuse_new",
        "expected true or false, got a string: \"yes\"",
    ),
    ("whole file too large", "#\n", 1, "", "a spec may be at most 1048576 bytes (1 MiB)"),
    ("missing apiVersion", "#\n", 1, "apiVersion", "is required"),
];

fn doc_for(case: &str, extra: &str) -> String {
    let mut base = BASE.to_string();
    match case {
        "wrong apiVersion" => base = base.replace("specd/v1", "specd/v2"),
        "bad name" => base = base.replace("name: t", "name: Bad_Name"),
        "unit path traversal" => base = base.replace("unit: t.service", "unit: ../x.service"),
        "unit with slash" => base = base.replace("unit: t.service", "unit: a/b.service"),
        "unit not a service" => base = base.replace("unit: t.service", "unit: t.socket"),
        "relative model" => base = base.replace("model: /m", "model: models/m"),
        "newline in model" => base = base.replace("model: /m", "model: \"/m\\nExecStartPre=/bin/rm -rf /\""),
        "NUL in model" => base = base.replace("model: /m", "model: \"/m\\0\""),
        "missing engine" => base = base.replace("  engine: sglang\n", ""),
        "missing apiVersion" => base = base.replace("apiVersion: specd/v1\n", ""),
        "huge model path" => base = base.replace("model: /m", &format!("model: /{}", "m".repeat(1_000_000))),
        "whole file too large" => base.push_str(&format!("# {}\n", "x".repeat(1 << 20))),
        "long model path" => base = base.replace("model: /m", &format!("model: /{}", "m".repeat(5000))),
        "long path component" => base = base.replace("model: /m", &format!("model: /a/{}", "m".repeat(300))),
        "long served name" => base.push_str(&format!("  server: {{served_model_name: {}}}\n", "n".repeat(300))),
        "long extra arg" => base.push_str(&format!("  server:\n    extra_args: [{}]\n", "x".repeat(5000))),
        "long command line" => {
            let arg = "y".repeat(4000);
            base.push_str(&format!("  server:\n    extra_args: [{}]\n", vec![arg.as_str(); 20].join(", ")))
        }
        "journald" => base = base.replace("unit: t.service", "unit: systemd-journald.service"),
        "dbus" => base = base.replace("unit: t.service", "unit: dbus.service"),
        "specd itself" => base = base.replace("unit: t.service", "unit: specd.service"),
        "sshd" => base = base.replace("unit: t.service", "unit: sshd.service"),
        c if c.starts_with("vllm") => base = base.replace("engine: sglang", "engine: vllm"),
        c if c.starts_with("llama") || c.ends_with("on llama") => {
            base = base.replace("engine: sglang", "engine: llama-cpp")
        }
        _ => {}
    }
    if extra != "#\n" {
        base.push_str(extra);
    }
    base
}

#[test]
fn each_bad_spec_gets_a_located_error() {
    assert!(CASES.len() >= 30);
    let mut failures = Vec::new();
    for (case, extra, line, path, fragment) in CASES {
        let text = doc_for(case, extra);
        let diags = specd_spec::check("specs/t.yaml", &text);
        let hit = diags
            .errors()
            .find(|d| d.line == *line && d.path == *path && d.message.contains(fragment) && d.file == "specs/t.yaml");
        match hit {
            Some(d) => {
                // The rendered form leads with file:line:col: path:
                let shown = d.to_string();
                let want = if path.is_empty() {
                    format!("specs/t.yaml:{line}:{}: ", d.column)
                } else {
                    format!("specs/t.yaml:{line}:{}: {path}: ", d.column)
                };
                if !shown.starts_with(&want) || d.column == 0 {
                    failures.push(format!("{case}: rendered as {shown:?}"));
                }
            }
            None => failures.push(format!(
                "{case}: wanted line {line} path {path:?} containing {fragment:?}, got:\n{diags}\n--- spec:\n{text}"
            )),
        }
    }
    assert!(failures.is_empty(), "{} case(s) failed:\n{}", failures.len(), failures.join("\n\n"));
}

#[test]
fn all_errors_of_a_file_are_reported_not_just_the_first() {
    let text = BASE.replace("model: /m", "model: m") + "  server: {port: 0}\n  service: {user: \"x y\"}\n";
    let diags = specd_spec::check("t.yaml", &text);
    let paths: Vec<&str> = diags.errors().map(|d| d.path.as_str()).collect();
    assert_eq!(paths, ["spec.model", "spec.server.port", "spec.service.user"], "{diags}");
}

#[test]
fn snippet_points_at_the_value() {
    let text = BASE.to_string() + "  server:\n    port: 70000\n";
    let d = specd_spec::check("t.yaml", &text);
    let shown = d.to_string();
    assert_eq!(
        shown,
        "t.yaml:10:11: spec.server.port: must be in 1..=65535, got 70000\n   |\n10 |     port: 70000\n   |           ^"
    );
}

#[test]
fn drain_budget_longer_than_stop_timeout_warns_but_validates() {
    let text = BASE.to_string() + "  service: {timeout_stop_sec: 10, drain_timeout_sec: 60}\n";
    let diags = specd_spec::check("t.yaml", &text);
    assert!(!diags.has_errors(), "{diags}");
    let w: Vec<_> = diags.warnings().collect();
    assert_eq!(w.len(), 1, "{diags}");
    assert_eq!(w[0].path, "spec.service.timeout_stop_sec");
    assert!(w[0].message.contains("SIGKILL"), "{}", w[0]);
    assert!(w[0].to_string().starts_with("t.yaml:9:31: warning: spec.service.timeout_stop_sec: "), "{}", w[0]);
}

#[test]
fn an_error_in_the_base_is_reported_once_not_per_host() {
    let text = BASE.replace("model: /m", "model: m") + "hosts:\n  a: {}\n  b: {}\n";
    let diags = specd_spec::check("t.yaml", &text);
    assert_eq!(diags.errors().count(), 1, "{diags}");
}

#[test]
fn an_error_that_several_overlays_cause_is_reported_once_naming_them() {
    let text = BASE.to_string()
        + "  server: {max_running_requests: 16}\n  speculative: {algorithm: NEXTN, num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}\nhosts:\n  a: {speculative: {algorithm: EAGLE}}\n  b: {speculative: {algorithm: EAGLE}}\n  c: {}\n";
    let diags = specd_spec::check("t.yaml", &text);
    let errors: Vec<String> = diags.errors().map(|d| d.to_string().lines().next().unwrap().to_string()).collect();
    assert_eq!(
        errors,
        [
            "t.yaml:10:3: spec.speculative.draft_model: is required by EAGLE: the path of the draft model (with the overlays for hosts a, b)"
        ],
        "{diags}"
    );
}

#[test]
fn secrets_may_be_named_by_where_they_are_or_kept_literal_on_purpose() {
    let ok = [
        "  service:\n    environment: {HF_TOKEN_PATH: /run/credentials/t.service/hf, DB_PASSWORD_FILE: /x, TOKENIZERS_PARALLELISM: \"false\", SPECD_STANDIN_TOKENS_PER_SEC: \"50\", MAX_TOKENS: \"9\"}\n",
        "  service:\n    environment: {HF_TOKEN: hf_public}\n    allow_literal_secrets: true\n",
        "  service:\n    environment_files: [/etc/specd/t.env, -/etc/specd/opt.env]\n    credentials: {hf_token: /etc/specd/hf, api.key: /etc/k}\n",
    ];
    for extra in ok {
        let d = specd_spec::check("t.yaml", &(BASE.to_string() + extra));
        assert!(d.0.is_empty(), "{extra}\n{d}");
    }
}

#[test]
fn secrets_on_the_command_line_may_be_kept_literal_on_purpose_and_files_and_tokens_of_text_pass() {
    let ok = [
        // The switch that allows literal secrets in the environment allows them on argv too.
        "  server:\n    extra_args: [--api-key, letmein, --x, sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t]\n  service: {allow_literal_secrets: true}\n",
        // Where the secret is, not what it is; flags about tokens of text.
        "  server:\n    extra_args: [--ssl-keyfile, /etc/k.pem, --max-total-tokens, \"8192\", --speculative-token-map, /m/map.pt]\n",
        "  server: {served_model_name: sk-llama-3-8b-instruct-finetuned}\n",
        "  speculative: {algorithm: NEXTN, num_steps: 1, eagle_topk: 1, num_draft_tokens: 2, draft_model: /models/hf_cache/Qwen3-8B}\n",
    ];
    for extra in ok {
        let d = specd_spec::check("t.yaml", &(BASE.to_string() + extra));
        assert!(!d.has_errors(), "{extra}\n{d}");
    }
}

#[test]
fn memory_limits_an_inference_server_can_start_under_pass() {
    for (engine, m) in [
        ("sglang", "1G"),
        ("sglang", "1.5G"),
        ("vllm", "200G"),
        ("sglang", "80%"),
        ("sglang", "infinity"),
        ("llama-cpp", "64M"),
    ] {
        let text =
            BASE.replace("engine: sglang", &format!("engine: {engine}")) + &format!("  service: {{memory_max: {m}}}\n");
        let d = specd_spec::check("t.yaml", &text);
        assert!(!d.has_errors(), "{engine} {m}\n{d}");
    }
}

#[test]
fn a_huge_key_is_cut_short_in_the_message() {
    let key = "K".repeat(1000);
    let text = BASE.to_string() + &format!("  service:\n    environment: {{{key}: x}}\n");
    let d = specd_spec::check("t.yaml", &text);
    let shown = d.to_string();
    assert!(d.has_errors() && shown.len() < 2000, "{} bytes", shown.len());
    assert!(shown.starts_with("t.yaml:10:1021: spec.service.environment.KKKK"), "{}", &shown[..100]);
    assert!(shown.contains("the variable name is 1000 bytes long; the limit is 255 bytes"));
}

#[test]
fn an_error_is_never_listed_twice() {
    // The program's path is checked as a word and as a path: one error.
    let text = BASE.to_string() + "  command: [\"/bin/x\\ny\"]\n";
    let diags = specd_spec::parse("t.yaml", &text).unwrap().resolve(None).unwrap_err();
    assert_eq!(diags.errors().count(), 1, "{diags}");
}

#[test]
fn a_key_with_a_newline_is_shown_on_one_line() {
    // Found by the fuzz test: `{0\n\n>}` is a key "0\n>".
    let shown = specd_spec::check("t.yaml", "{0\n\n>}").to_string();
    assert!(shown.starts_with("t.yaml:1:2: 0\\n>: unknown field `0\\n>`, expected one of"), "{shown}");
    assert_eq!(shown.lines().count(), 4, "{shown}");
}

#[test]
fn a_long_line_is_shown_as_a_window_around_the_error() {
    let text = BASE.to_string() + &format!("  server: {{extra_args: [{}], port: 0}}\n", "n".repeat(2000));
    let shown = specd_spec::check("t.yaml", &text).to_string();
    assert!(shown.starts_with("t.yaml:9:2034: spec.server.port: must be in 1..=65535, got 0\n"), "{shown}");
    let lines: Vec<&str> = shown.lines().collect();
    assert!(lines.len() == 4 && lines[2].len() < 200, "{shown}");
    assert!(lines[2].ends_with("port: 0}"), "{shown}");
    // The caret stands under the value.
    let caret = lines[3].chars().count() - 1;
    assert_eq!(lines[2].chars().nth(caret), Some('0'), "{shown}");
}

/// A group's spare is held stopped at rest: its failed start is left stopped (no rollback) and it
/// does not start at boot, unless its spec says otherwise; a replica keeps both defaults on.
#[test]
fn a_spare_defaults_to_no_rollback_and_no_start_at_boot() {
    let resolve = |extra: &str| {
        let yaml = format!(
            "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: q}}\nspec:\n  unit: q.service\n  engine: sglang\n  model: /m\n{extra}"
        );
        let s = specd_spec::parse("q.yaml", &yaml).unwrap().resolve(None).unwrap();
        (s.policy.rollback, s.service.enabled)
    };
    assert_eq!(resolve("  rollout: {group: llm, max_surge: 1}\n"), (true, true));
    assert_eq!(resolve("  rollout: {group: llm, max_surge: 1, spare: true}\n"), (false, false));
    let said = "  rollout: {group: llm, spare: true}\n  policy: {rollback: true}\n  service: {enabled: true}\n";
    assert_eq!(resolve(said), (true, true));
}
