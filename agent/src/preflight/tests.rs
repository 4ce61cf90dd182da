//! The pure checks, on their tables of cases.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::checks::{ServiceSection, checks, credential, environment_file, gpus, looks_like_repo_id, unspecify};
use super::files::engine_reads;
use super::look::Found;
use super::port::{Listener, collides, hex_addr, in_cgroup, listening, unit_cgroup};
use super::program::{Shebang, interpreter_name, shebang};
use super::*;

const UNIT: &str = "sglang-qwen.service";

fn resolve(body: &str) -> Spec {
    let yaml = format!("apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: qwen}}\nspec:\n{body}");
    specd_spec::parse("t.yaml", &yaml).unwrap().resolve(None).unwrap()
}

fn full_spec() -> Spec {
    resolve(&format!(
        "  unit: {UNIT}\n  engine: sglang\n  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]\n  model: /models/Qwen3.5-122B-A10B\n  server: {{port: 30000}}\n  speculative: {{algorithm: EAGLE, draft_model: /models/draft, num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}\n  service:\n    user: sglang\n    group: gpu\n    working_directory: /opt/sglang\n    environment: {{CUDA_VISIBLE_DEVICES: \"0,1\"}}\n    environment_files: [/etc/sglang/env, -/etc/sglang/optional.env]\n    credentials: {{hf_token: /run/secrets/hf-token}}\n"
    ))
}

fn user(u: &str, g: Option<&str>) -> RunAs {
    RunAs::User { user: u.to_string(), group: g.map(str::to_string) }
}

fn s(v: &str) -> String {
    v.to_string()
}

/// `judge` where specd's view is the host's.
fn judge(unit: &str, file: &str, success: bool, output: &str) -> Vec<Found> {
    super::verify::judge(unit, file, success, output, true)
}

// The pure part.

#[test]
fn a_spec_s_checks_come_from_its_unit_text_and_its_engine_s_flags() {
    let spec = full_spec();
    let text = specd_spec::render(&spec).text;
    let as_ = user("sglang", Some("gpu"));
    let cwd = Cwd::Path(s("/opt/sglang"));
    let model = |role, value: &str| Check::Model {
        role,
        value: s(value),
        form: ModelForm::FolderOrGguf,
        cwd: cwd.clone(),
        runs_as: as_.clone(),
        sandbox: Sandbox::default(),
        verify: Verify::None,
    };
    assert_eq!(
        checks(&spec, &text, &[]),
        [
            Check::User { name: s("sglang") },
            Check::Group { name: s("gpu") },
            Check::Program {
                program: Program::Path(s("/opt/sglang/bin/python3")),
                runs_as: as_.clone(),
                sandbox: Sandbox::default()
            },
            Check::WorkingDirectory {
                dir: cwd.clone(),
                optional: false,
                runs_as: as_.clone(),
                sandbox: Sandbox::default()
            },
            model(ModelRole::Model, "/models/Qwen3.5-122B-A10B"),
            model(ModelRole::Draft, "/models/draft"),
            Check::EnvironmentFile { path: s("/etc/sglang/env"), optional: false },
            Check::EnvironmentFile { path: s("/etc/sglang/optional.env"), optional: true },
            Check::Credential { id: s("hf_token"), path: s("/run/secrets/hf-token") },
            Check::Port { unit: s(UNIT), host: s("127.0.0.1"), port: 30000 },
            Check::Gpus { indices: vec![0, 1] },
            Check::UnitFile { unit: s(UNIT), text: text.clone() },
        ]
    );
}

#[test]
fn a_bare_program_is_looked_up_in_systemd_s_search_path_and_llama_cpp_loads_gguf_files() {
    let spec = resolve(
        "  unit: llama.service\n  engine: llama-cpp\n  model: /models/m.gguf\n  speculative: {draft_model: /models/d.gguf}\n",
    );
    let text = specd_spec::render(&spec).text;
    let model = |role, value: &str| Check::Model {
        role,
        value: s(value),
        form: ModelForm::GgufFile,
        cwd: Cwd::Path(s("/")),
        runs_as: RunAs::Root,
        sandbox: Sandbox::default(),
        verify: Verify::None,
    };
    let search = SEARCH_PATH.iter().map(|d| s(d)).collect();
    assert_eq!(
        checks(&spec, &text, &[]),
        [
            Check::Program {
                program: Program::Search { name: s("llama-server"), dirs: search },
                runs_as: RunAs::Root,
                sandbox: Sandbox::default(),
            },
            model(ModelRole::Model, "/models/m.gguf"),
            model(ModelRole::Draft, "/models/d.gguf"),
            Check::Port { unit: s("llama.service"), host: s("127.0.0.1"), port: 8080 },
            Check::UnitFile { unit: s("llama.service"), text: text.clone() },
        ]
    );
}

#[test]
fn the_unit_text_is_what_systemd_sees() {
    let spec = full_spec();
    // Another program, a search path of the unit's own, a dynamic user, `~`, specifiers,
    // a wildcard, a credential without a path, a GPU UUID.
    let text = "[Unit]\nUser=not-this-one\n[Service]\n# User=nor-this\nExecStart=/x\nExecStart=\nExecStart=-tool \\\n  --flag\nExecSearchPath=/opt/bin\nExecSearchPath=/opt/sbin\nUser=qwen\nDynamicUser=yes\nWorkingDirectory=-~\nEnvironment=\"CUDA_VISIBLE_DEVICES=GPU-8f2e,1\"\nEnvironmentFile=/etc/%h/env\nEnvironmentFile=-/etc/a*.env\nLoadCredential=tok\n";
    let got = checks(&spec, text, &[]);
    let program = Program::Search { name: s("tool"), dirs: vec![s("/opt/bin"), s("/opt/sbin")] };
    // A dynamic user has a /tmp of its own.
    let implied = |dir: &str| Shadow { dir: s(dir), setting: s("DynamicUser=yes (which implies PrivateTmp=yes)") };
    let sandbox = Sandbox { hidden: vec![implied("/tmp"), implied("/var/tmp")], elsewhere: vec![] };
    assert_eq!(got[0], Check::Program { program, runs_as: RunAs::Dynamic, sandbox: sandbox.clone() }, "{got:#?}");
    assert_eq!(got[1], Check::WorkingDirectory { dir: Cwd::Home, optional: true, runs_as: RunAs::Dynamic, sandbox });
    let kinds: Vec<(CheckKind, bool)> = got.iter().map(|c| (c.kind(), matches!(c, Check::NotChecked { .. }))).collect();
    assert_eq!(
        kinds,
        [
            (CheckKind::Program, false),
            (CheckKind::WorkingDirectory, false),
            (CheckKind::Model, false),
            (CheckKind::DraftModel, false),
            (CheckKind::EnvironmentFile, true),
            (CheckKind::EnvironmentFile, true),
            (CheckKind::Credential, true),
            (CheckKind::Port, false),
            (CheckKind::Gpu, false),
            (CheckKind::Gpu, true),
            (CheckKind::UnitFile, false),
        ]
    );
    let why = |i: usize| match &got[i] {
        Check::NotChecked { why, .. } => why.clone(),
        c => panic!("{c:?}"),
    };
    assert_eq!(why(4), "EnvironmentFile=/etc/%h/env uses the specifier %h, which the pre-flight does not resolve");
    assert_eq!(why(5), "the environment files /etc/a*.env are a wildcard: whether they match is not checked");
    assert_eq!(
        why(6),
        "the credential tok is passed on from the service manager or its credential store, not read from a path"
    );
    assert_eq!(got[8], Check::Gpus { indices: vec![1] });
    assert_eq!(why(9), "CUDA_VISIBLE_DEVICES names GPU-8f2e: GPU UUIDs and MIG ids need the driver's tools");
    // Without an `ExecStart=` specd's parser reads, the spec's argv.
    let got = checks(&spec, "[Service]\nExecStart=/opt/%n serve\n", &[]);
    assert_eq!(
        got[0],
        Check::Program {
            program: Program::Path(s("/opt/sglang/bin/python3")),
            runs_as: RunAs::Root,
            sandbox: Sandbox::default()
        }
    );
}

#[test]
fn the_unit_s_sandbox_is_read_from_the_unit_and_its_drop_ins() {
    let spec = full_spec();
    let text = specd_spec::render(&spec).text;
    let sandbox = |drop_ins: &[(&str, &str)]| {
        let d: Vec<(String, String)> = drop_ins.iter().map(|(p, t)| (s(p), format!("[Service]\n{t}"))).collect();
        match checks(&spec, &text, &d).into_iter().find(|c| matches!(c, Check::Model { .. })) {
            Some(Check::Model { sandbox, .. }) => sandbox,
            c => panic!("{c:?}"),
        }
    };
    let at = |dir: &str, setting: &str| Shadow { dir: s(dir), setting: s(setting) };
    // The rendered unit has none: specd's specs cannot ask for one.
    assert_eq!(sandbox(&[]), Sandbox::default());
    let a = "/etc/systemd/system/service.d/a.conf";
    let b = "/etc/systemd/system/sglang-.service.d/b.conf";
    assert_eq!(
        sandbox(&[(a, "PrivateTmp=yes\nProtectHome=read-only\n")]),
        Sandbox {
            hidden: vec![
                at("/tmp", &format!("PrivateTmp=yes (in {a})")),
                at("/var/tmp", &format!("PrivateTmp=yes (in {a})"))
            ],
            elsewhere: vec![]
        }
    );
    // A later drop-in wins; `tmpfs` hides /home as `yes` does.
    let home = |setting: &str| vec![at("/home", setting), at("/root", setting), at("/run/user", setting)];
    assert_eq!(
        sandbox(&[(a, "PrivateTmp=yes\nProtectHome=yes\n"), (b, "PrivateTmp=no\nProtectHome=tmpfs\n")]),
        Sandbox { hidden: home(&format!("ProtectHome=tmpfs (in {b})")), elsewhere: vec![] }
    );
    let lists = "InaccessiblePaths=-/srv/secret /opt/x\nInaccessiblePaths=\nInaccessiblePaths=/data\nTemporaryFileSystem=/var/cache:ro\nBindReadOnlyPaths=/srv/models:/models -/same\nBindPaths=/a:/b:rbind\nRootDirectory=\n";
    let setting = |v: &str| format!("{v} (in {a})");
    assert_eq!(
        sandbox(&[(a, lists)]),
        Sandbox {
            hidden: vec![
                at("/data", &setting("InaccessiblePaths=/data")),
                at("/var/cache", &setting("TemporaryFileSystem=/var/cache:ro")),
            ],
            elsewhere: vec![
                at("/models", &setting("BindReadOnlyPaths=/srv/models:/models -/same")),
                at("/b", &setting("BindPaths=/a:/b:rbind")),
            ],
        }
    );
    assert_eq!(
        sandbox(&[(a, "RootDirectory=/srv/root\nBindPaths=/x:%t/y\n")]).elsewhere,
        [at("/", &setting("RootDirectory=/srv/root")), at("/", &setting("BindPaths=/x:%t/y"))]
    );
    // A drop-in's other settings count too: who runs the program.
    let c = checks(&spec, &text, &[(s(a), s("[Service]\nUser=other\n"))]);
    assert!(c.contains(&Check::User { name: s("other") }), "{c:?}");
}

#[test]
fn the_program_s_prefixes_and_the_user_settings_decide_who_runs_it() {
    let exec_as = |lines: &str| {
        let svc = ServiceSection::read(&format!("[Service]\n{lines}"));
        svc.runs_as(svc.user.clone(), svc.group.clone())
    };
    let qwen = user("qwen", None);
    for (lines, want) in [
        ("ExecStart=/x\n", RunAs::Root),
        ("ExecStart=/x\nUser=qwen\n", qwen.clone()),
        ("ExecStart=/x\nUser=qwen\nGroup=gpu\n", user("qwen", Some("gpu"))),
        ("ExecStart=/x\nGroup=gpu\n", RunAs::Root),
        ("ExecStart=/x\nUser=root\n", RunAs::Root),
        ("ExecStart=/x\nUser=0\n", RunAs::Root),
        ("ExecStart=/x\nUser=qwen\nUser=\n", RunAs::Root),
        // Full privileges; no user change; `!!` changes nothing with ambient capabilities.
        ("ExecStart=+/x\nUser=qwen\n", RunAs::Root),
        ("ExecStart=!/x\nUser=qwen\n", RunAs::Root),
        ("ExecStart=!!/x\nUser=qwen\n", qwen.clone()),
        ("ExecStart=-@:/x x\nUser=qwen\n", qwen.clone()),
        ("ExecStart=-+/x\nUser=qwen\n", RunAs::Root),
        ("ExecStart=/x\nUser=qwen\nDynamicUser=yes\n", RunAs::Dynamic),
        ("ExecStart=/x\nDynamicUser=true\n", RunAs::Dynamic),
        ("ExecStart=/x\nDynamicUser=no\nUser=qwen\n", qwen.clone()),
        ("ExecStart=!/x\nDynamicUser=yes\n", RunAs::Root),
    ] {
        assert_eq!(exec_as(lines), want, "{lines}");
    }
}

#[test]
fn users_groups_and_working_directories_are_checked_as_systemd_reads_them() {
    let spec = full_spec();
    let got = |lines: &str| checks(&spec, &format!("[Service]\nExecStart=/x\n{lines}"), &[]);
    // A dynamic user is made at the start: nothing to look up.
    assert!(!got("User=qwen\nDynamicUser=yes\n").iter().any(|c| matches!(c, Check::User { .. })));
    assert_eq!(got("User=1000\n")[0], Check::User { name: s("1000") });
    let c = got("User=%u\n");
    assert_eq!(c[0].kind(), CheckKind::User);
    assert!(matches!(&c[0], Check::NotChecked { why, .. } if why.contains("%u")), "{c:?}");
    assert_eq!(
        c[1],
        Check::Program { program: Program::Path(s("/x")), runs_as: RunAs::Root, sandbox: Sandbox::default() }
    );
    for (lines, dir, optional) in [
        ("WorkingDirectory=/srv/m\n", Cwd::Path(s("/srv/m")), false),
        ("WorkingDirectory=-/srv/m\n", Cwd::Path(s("/srv/m")), true),
        ("WorkingDirectory=~\n", Cwd::Home, false),
        ("WorkingDirectory=/srv/100%%\n", Cwd::Path(s("/srv/100%")), false),
    ] {
        let c = got(lines);
        assert_eq!(
            c[1],
            Check::WorkingDirectory { dir: dir.clone(), optional, runs_as: RunAs::Root, sandbox: Sandbox::default() },
            "{lines}"
        );
        // A relative model would be looked for there.
        assert!(matches!(&c[2], Check::Model { cwd, .. } if *cwd == dir), "{c:?}");
    }
}

#[test]
fn environment_and_credentials_as_the_unit_lists_them() {
    let svc = ServiceSection::read(
        "[Service]\nEnvironment=\"A=1\"\nEnvironment=\nEnvironment=\"CUDA_VISIBLE_DEVICES=0\"\nEnvironment=\"CUDA_VISIBLE_DEVICES=2,3\"\nEnvironmentFile=/a\nEnvironmentFile=\nEnvironmentFile=-/b\nLoadCredential=x:/c\n",
    );
    assert_eq!(svc.environment, [r#""CUDA_VISIBLE_DEVICES=0""#, r#""CUDA_VISIBLE_DEVICES=2,3""#]);
    assert_eq!(svc.environment("CUDA_VISIBLE_DEVICES").as_deref(), Some("2,3"));
    assert_eq!(svc.environment("A"), None);
    assert_eq!(svc.environment_files, ["-/b"]);
    assert_eq!(environment_file("-/b"), Check::EnvironmentFile { path: s("/b"), optional: true });
    assert_eq!(environment_file("/100%%.env"), Check::EnvironmentFile { path: s("/100%.env"), optional: false });
    assert!(matches!(environment_file("b.env"), Check::NotChecked { why, .. } if why.contains("not an absolute path")));
    assert_eq!(credential("x:/c"), Check::Credential { id: s("x"), path: s("/c") });
    assert!(matches!(credential("x:%d/c"), Check::NotChecked { why, .. } if why.contains("%d")));
}

#[test]
fn specifiers_other_than_a_percent_sign_are_not_resolved() {
    assert_eq!(unspecify("/a/100%%/b"), Ok(s("/a/100%/b")));
    assert_eq!(unspecify("plain"), Ok(s("plain")));
    assert_eq!(unspecify("%h/x"), Err(s("%h")));
    assert_eq!(unspecify("x%"), Err(s("%")));
}

#[test]
fn cuda_visible_devices_is_read_as_cuda_reads_it() {
    let gpu = |v: &str| gpus(v);
    assert_eq!(gpu("0,1, 2"), [Check::Gpus { indices: vec![0, 1, 2] }]);
    assert_eq!(gpu("GPU-1,MIG-2").len(), 1);
    assert!(
        matches!(&gpu("GPU-1,MIG-2")[0], Check::NotChecked { kind: CheckKind::Gpu, why } if why.contains("GPU-1, MIG-2"))
    );
    let hidden = gpu("-1");
    assert!(matches!(&hidden[..], [Check::NotChecked { why, .. }] if why.contains("CUDA ignores `-1`")), "{hidden:?}");
    let cut = gpu("0,x,3");
    assert_eq!(cut[0], Check::Gpus { indices: vec![0] }, "3 comes after an entry CUDA stops at");
    assert_eq!(cut.len(), 2);
    assert!(gpu("").iter().all(|c| matches!(c, Check::NotChecked { .. })));
}

#[test]
fn hugging_face_repo_ids_are_told_from_paths() {
    for id in ["Qwen/Qwen3-8B", "gpt2", "meta-llama/Llama-3.1-8B-Instruct", "a_b/c.d"] {
        assert!(looks_like_repo_id(id), "{id}");
    }
    for p in ["/models/x", "./x", "../x", "~/x", "a/b/c", "a//b", "-a/b", "a./b", "a--b/c", "a..b", "", "a b/c"] {
        assert!(!looks_like_repo_id(p), "{p}");
    }
}

#[test]
fn listening_sockets_are_read_from_proc_net_tcp() {
    // Addresses as the kernel prints them: each 32-bit word in this host's byte order.
    let v4 = |a: [u8; 4]| format!("{:08X}", u32::from_ne_bytes(a));
    let v6 = |a: Ipv6Addr| a.octets().chunks(4).map(|w| v4([w[0], w[1], w[2], w[3]])).collect::<String>();
    let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";
    let row = |addr: &str, port: u16, st: &str, inode: u64| {
        format!(
            "   0: {addr}:{port:04X} 00000000:0000 {st} 00000000:00000000 00:00000000 00000000  1000        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
        )
    };
    let text = header.to_string()
        + &row(&v4([127, 0, 0, 1]), 30000, "0A", 11)
        + &row(&v4([0, 0, 0, 0]), 30000, "01", 12)
        + &row(&v4([10, 1, 2, 3]), 8080, "0A", 13);
    let l = listening(&text, 30000);
    assert_eq!(l, [Listener { addr: IpAddr::from([127, 0, 0, 1]), uid: 1000, inode: 11 }]);
    let text6 = header.to_string()
        + &row(&v6(Ipv6Addr::UNSPECIFIED), 8000, "0A", 21)
        + &row(&v6(Ipv4Addr::new(127, 0, 0, 1).to_ipv6_mapped()), 8000, "0A", 22);
    let addrs: Vec<IpAddr> = listening(&text6, 8000).iter().map(|l| l.addr).collect();
    assert_eq!(addrs, [IpAddr::from(Ipv6Addr::UNSPECIFIED), IpAddr::from([127, 0, 0, 1])]);
    assert_eq!(hex_addr("XYZ"), None);
}

#[test]
fn a_bind_collides_with_the_same_address_or_a_wildcard_of_its_family() {
    let ip = |a: &str| a.parse::<IpAddr>().unwrap();
    for (ours, theirs, want) in [
        ("127.0.0.1", "127.0.0.1", true),
        ("127.0.0.1", "0.0.0.0", true),
        ("0.0.0.0", "127.0.0.1", true),
        ("127.0.0.1", "10.0.0.1", false),
        // A v6 wildcard takes IPv4 too; a v4 wildcard no IPv6.
        ("127.0.0.1", "::", true),
        ("::", "10.0.0.1", true),
        ("::1", "0.0.0.0", false),
        ("0.0.0.0", "::1", false),
        ("::1", "::1", true),
        ("::1", "::2", false),
    ] {
        assert_eq!(collides(Some(ip(ours)), ip(theirs)), want, "{ours} vs {theirs}");
    }
    assert!(collides(None, ip("10.0.0.1")), "a host name may be any address");
}

#[test]
fn a_process_s_cgroup_and_whether_it_is_the_unit_s() {
    assert_eq!(unit_cgroup("0::/system.slice/a.service\n").as_deref(), Some("/system.slice/a.service"));
    let hybrid =
        "12:memory:/system.slice/a.service\n1:name=systemd:/system.slice/a.service\n0::/system.slice/a.service\n";
    assert_eq!(unit_cgroup(hybrid).as_deref(), Some("/system.slice/a.service"));
    assert_eq!(unit_cgroup("1:name=systemd:/system.slice/b.service\n").as_deref(), Some("/system.slice/b.service"));
    assert_eq!(unit_cgroup("garbage\n"), None);
    let own = "/system.slice/a.service";
    assert!(in_cgroup("/system.slice/a.service", own));
    assert!(in_cgroup("/system.slice/a.service/worker", own));
    assert!(!in_cgroup("/system.slice/a.service2", own));
    assert!(!in_cgroup("/system.slice/a.service", ""), "no instance: nothing is the unit's");
}

#[test]
fn systemd_analyze_verify_s_word_on_a_program_specd_sees_in_another_view_is_a_note() {
    let file = "/tmp/specd-preflight.x/a.service";
    let cmd = "a.service: Command /tmp/llama-server is not executable: No such file or directory\n";
    let note = Found::Note(s(
        "not checked: systemd-analyze verify, run in specd's own view of the file system, which is not the host's: a.service: Command /tmp/llama-server is not executable: No such file or directory",
    ));
    assert_eq!(super::verify::judge("a.service", file, false, cmd, false), std::slice::from_ref(&note));
    assert_eq!(
        super::verify::judge("a.service", file, false, cmd, true),
        [Found::Problem(format!("systemd-analyze verify: {}", cmd.trim()))]
    );
    // Anything else it says stays its verdict.
    let both =
        format!("{cmd}/tmp/specd-preflight.x/a.service:8: Unknown key 'BogusKey' in section [Service], ignoring.\n");
    assert_eq!(
        super::verify::judge("a.service", file, false, &both, false),
        [
            note,
            Found::Problem(s(
                "systemd-analyze verify: a.service:8: Unknown key 'BogusKey' in section [Service], ignoring."
            ))
        ]
    );
}

#[test]
fn systemd_analyze_verify_s_verdict_is_its_exit_status_and_its_lines_about_the_unit() {
    let file = "/tmp/specd-preflight.x/a.service";
    let nobody = "/tmp/specd-preflight.x/a.service:9: Special user nobody configured, this is not safe!";
    assert_eq!(judge("a.service", file, true, ""), []);
    assert_eq!(
        judge("a.service", file, true, nobody),
        [Found::Note(s("systemd-analyze verify: a.service:9: Special user nobody configured, this is not safe!"))]
    );
    // What systemd 252 printed for a unit whose program does not exist (exit status 1).
    let missing = format!(
        "{nobody}\na.service: Command /opt/nowhere/vllm is not executable: No such file or directory\nb.service: something else\n"
    );
    assert_eq!(
        judge("a.service", file, false, &missing),
        [Found::Problem(s(
            "systemd-analyze verify: a.service:9: Special user nobody configured, this is not safe!; a.service: Command /opt/nowhere/vllm is not executable: No such file or directory"
        ))]
    );
    let bad_key = "/tmp/specd-preflight.x/a.service:8: Unknown key 'BogusKey' in section [Service], ignoring.\n";
    assert_eq!(
        judge("a.service", file, false, bad_key),
        [Found::Problem(s(
            "systemd-analyze verify: a.service:8: Unknown key 'BogusKey' in section [Service], ignoring."
        ))]
    );
    // An older systemd without the option: nothing known about the unit.
    assert_eq!(
        judge("a.service", file, false, "systemd-analyze: unrecognized option '--recursive-errors=no'\n"),
        [Found::Note(s(
            "not checked: systemd-analyze verify failed without naming a.service: systemd-analyze: unrecognized option '--recursive-errors=no'"
        ))]
    );
}

#[test]
fn an_engine_reads_a_model_folder_s_config_weights_and_tokenizer_only() {
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model-00001-of-00004.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "vocab.txt",
        "merges.txt",
        "qwen.tiktoken",
        "chat_template.jinja",
        "preprocessor_config.json",
        "modeling_custom.py",
    ] {
        assert!(engine_reads(name, true), "{name}");
    }
    for name in [
        "README.md",
        "LICENSE",
        ".gitattributes",
        "trainer_state.json",
        "figure.png",
        "pytorch_model.bin",
        "consolidated.pth",
        "m.gguf",
    ] {
        assert!(!engine_reads(name, true), "{name}, with safetensors there");
    }
    // Without safetensors, PyTorch's weights, but not training state.
    for (name, read) in [
        ("pytorch_model-00001-of-00002.bin", true),
        ("pytorch_model.bin.index.json", true),
        ("consolidated.pth", true),
        ("training_args.bin", false),
        ("optimizer.pt", false),
        ("model.safetensors.index.json", false),
    ] {
        assert_eq!(engine_reads(name, false), read, "{name}, without safetensors");
    }
}

#[test]
fn a_shebang_is_read_as_the_kernel_reads_it() {
    let i = |v: &str| Shebang::Interpreter(v.as_bytes().to_vec());
    let long = |tail: &str| format!("#!/bin/sh{tail}");
    for (head, want) in [
        ("#!/bin/sh\n", i("/bin/sh")),
        ("#!/bin/sh", i("/bin/sh")),
        ("#!/bin/sh\r\n", i("/bin/sh\r")),
        ("#!/bin/sh \r\n", i("/bin/sh")),
        ("#! \t/usr/bin/env  python3 -u \t\n", i("/usr/bin/env")),
        ("#!/bin/sh\x0bx\n", i("/bin/sh\x0bx")),
        ("#!/bin/sh\0-e\n", i("/bin/sh")),
        ("#!/bin/sh -e\n#!/other\n", i("/bin/sh")),
        ("#!\n", Shebang::Unusable("its first line holds no interpreter")),
        ("#! \t \n/bin/sh\n", Shebang::Unusable("its first line holds no interpreter")),
        ("#!", Shebang::Unusable("its first line holds no interpreter")),
        ("#!\0/bin/sh\n", Shebang::Unusable("its first line holds no interpreter")),
        ("\u{feff}#!/bin/sh\n", Shebang::NotAScript),
        (" #!/bin/sh\n", Shebang::NotAScript),
        ("\x7fELF", Shebang::NotAScript),
        ("", Shebang::NotAScript),
    ] {
        assert_eq!(shebang(head.as_bytes()), want, "{head:?}");
    }
    // Past the kernel's 256 bytes: a name that ends within them is taken, its argument cut;
    // a name that does not is refused rather than cut.
    assert_eq!(shebang(long(&format!(" {}", "a".repeat(300))).as_bytes()), i("/bin/sh"));
    assert_eq!(shebang(long(&" ".repeat(300)).as_bytes()), i("/bin/sh"));
    assert_eq!(
        shebang(format!("#!/{}", "a".repeat(300)).as_bytes()),
        Shebang::Unusable("its first line is longer than the kernel reads, which would cut the interpreter's name")
    );
    // A newline as the 256th byte is seen, one after it is not.
    assert_eq!(shebang(format!("#!/{}\n", "b".repeat(252)).as_bytes()), i(&format!("/{}", "b".repeat(252))));
    assert!(matches!(shebang(format!("#!/{}\n", "b".repeat(253)).as_bytes()), Shebang::Unusable(_)));
    assert_eq!(interpreter_name(b"/bin/sh"), "/bin/sh");
    assert_eq!(interpreter_name(b"/bin/sh\r"), "\"/bin/sh\\r\"");
}

#[test]
fn a_refusal_says_all_its_problems_in_one_line() {
    let p = |check, m: &str| Problem { check, message: s(m) };
    assert_eq!(summary(&[]), "");
    assert_eq!(
        summary(&[
            p(CheckKind::Program, "the program /opt/nowhere/vllm does not exist"),
            p(CheckKind::DraftModel, "the draft model /models/no-such-draft does not exist"),
        ]),
        "the program /opt/nowhere/vllm does not exist; the draft model /models/no-such-draft does not exist"
    );
}

#[test]
fn checks_and_problems_serialize_for_state_and_notices() {
    let c = Check::Model {
        role: ModelRole::Draft,
        value: s("/m"),
        form: ModelForm::GgufFile,
        cwd: Cwd::Home,
        runs_as: user("qwen", None),
        sandbox: Sandbox::default(),
        verify: Verify::None,
    };
    let j = serde_json::to_value(&c).unwrap();
    assert_eq!(
        j,
        serde_json::json!({"check": "model", "role": "draft", "value": "/m", "form": "gguf_file", "cwd": "home", "runs_as": {"user": {"user": "qwen", "group": null}}})
    );
    assert_eq!(serde_json::from_value::<Check>(j).unwrap(), c);
    let p = Problem { check: CheckKind::DraftModel, message: s("m") };
    assert_eq!(serde_json::to_value(&p).unwrap(), serde_json::json!({"check": "draft_model", "message": "m"}));
}

#[test]
fn the_search_path_is_this_host_s_systemd_s() {
    let Ok(out) = std::process::Command::new("systemd-path").arg("search-binaries-default").output() else {
        return;
    };
    // systemd 252 as Debian 12 builds it: the same; later ones: a part, in the same order.
    let theirs = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let mut ours = SEARCH_PATH.iter();
    for d in theirs.split(':') {
        assert!(ours.any(|o| *o == d), "{d} of {theirs} is not in {SEARCH_PATH:?} in this order");
    }
}
