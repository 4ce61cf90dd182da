//! The executor on real files, a real socket, real users and the real `systemd-analyze`.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use super::checks::checks;
use super::files::{look_gpus, look_group, look_user};
use super::look::{Found, Machine, Who, who};
use super::port::{cgroup_of, look_port};
use super::verify::verify;
use super::*;

fn s(v: &str) -> String {
    v.to_string()
}

fn problem(m: impl Into<String>) -> Found {
    Found::Problem(m.into())
}

fn nobody() -> RunAs {
    RunAs::User { user: s("nobody"), group: None }
}

// The looks as specd sees its own view, for a unit without a sandbox.
fn look_program(p: &Program, as_: &RunAs) -> Vec<Found> {
    super::program::look_program(&Sight::Own, p, as_, &Sandbox::default())
}

fn look_model(role: ModelRole, v: &str, form: ModelForm, cwd: &Cwd, as_: &RunAs) -> Vec<Found> {
    super::files::look_model(&Sight::Own, role, v, form, cwd, as_, &Sandbox::default())
}

fn look_environment_file(path: &str, optional: bool) -> Vec<Found> {
    super::files::look_environment_file(&Sight::Own, path, optional)
}

fn look_credential(id: &str, path: &str) -> Vec<Found> {
    super::files::look_credential(&Sight::Own, id, path)
}

fn look_working_directory(dir: &Cwd, optional: bool, as_: &RunAs) -> Vec<Found> {
    super::files::look_working_directory(&Sight::Own, dir, optional, as_, &Sandbox::default())
}

/// A temporary directory others may enter, as a model directory usually is.
fn open_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

fn write(path: &Path, bytes: &[u8], mode: u32) -> String {
    std::fs::write(path, bytes).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.display().to_string()
}

fn mkdir(path: &Path, mode: u32) -> String {
    std::fs::create_dir(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.display().to_string()
}

/// The one problem found, which must start with `start`.
#[track_caller]
fn one_problem_starting(found: Vec<Found>, start: &str) -> String {
    match &found[..] {
        [Found::Problem(m)] if m.starts_with(start) => m.clone(),
        _ => panic!("expected one problem starting with {start:?}, got {found:?}"),
    }
}

fn resolve(body: &str) -> Spec {
    let yaml = format!("apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: t}}\nspec:\n{body}");
    specd_spec::parse("t.yaml", &yaml).unwrap().resolve(None).unwrap()
}

#[test]
fn a_program_that_is_missing_or_cannot_run_is_named() {
    let d = open_dir();
    let p = |n: &str| d.path().join(n);
    let tool = write(&p("tool"), b"\x7fELF", 0o755);
    let plain = write(&p("plain"), b"x", 0o644);
    let mine = write(&p("mine"), b"\x7fELF", 0o700);
    let script = write(&p("script"), b"#!/no/such/interp -u\nprint()\n", 0o755);
    let good_script = write(&p("good-script"), b"#!/bin/sh\nexit 0\n", 0o755);
    let unreadable_script = write(&p("unreadable-script"), b"#!/bin/sh\nexit 0\n", 0o711);
    std::os::unix::fs::symlink(p("nowhere"), p("dangling")).unwrap();
    let path = |v: &str| Program::Path(s(v));
    let look = |prog: Program, as_: &RunAs| look_program(&prog, as_);
    assert_eq!(
        look(path("/opt/nowhere/vllm"), &RunAs::Root),
        [problem("the program /opt/nowhere/vllm does not exist")]
    );
    assert_eq!(look(path(&tool), &RunAs::Root), []);
    assert_eq!(look(path(&tool), &nobody()), []);
    assert_eq!(look(path(&good_script), &nobody()), []);
    one_problem_starting(
        look(path(&plain), &RunAs::Root),
        &format!("the program {plain} is not executable (mode 0644, owner "),
    );
    assert_eq!(look(path(&mine), &RunAs::Root), []);
    one_problem_starting(
        look(path(&mine), &nobody()),
        &format!("user nobody cannot execute the program {mine} (mode 0700, owner "),
    );
    one_problem_starting(
        look(path(&unreadable_script), &nobody()),
        &format!("user nobody cannot read the script {unreadable_script} (mode 0711, owner "),
    );
    assert_eq!(
        look(path(&script), &RunAs::Root),
        [problem(format!("the program {script} is a script whose interpreter /no/such/interp does not exist"))]
    );
    let dir = d.path().display().to_string();
    assert_eq!(look(path(&dir), &RunAs::Root), [problem(format!("the program {dir} is a directory"))]);
    assert_eq!(
        look(path(&p("dangling").display().to_string()), &RunAs::Root),
        [problem(format!(
            "the program {} is a symbolic link to {}, which does not exist",
            p("dangling").display(),
            p("nowhere").display()
        ))]
    );
    assert_eq!(
        look(path("opt/vllm"), &RunAs::Root),
        [problem("the program opt/vllm is neither an absolute path nor a bare name: systemd refuses it")]
    );
    // Bare names, in systemd's search path or the unit's own; a file without an execute
    // bit is not found.
    let search =
        |name: &str, dirs: &[&str]| Program::Search { name: s(name), dirs: dirs.iter().map(|d| s(d)).collect() };
    assert_eq!(look(search("sh", &SEARCH_PATH), &RunAs::Root), []);
    assert_eq!(
        look(search("no-such-program-x", &SEARCH_PATH), &RunAs::Root),
        [problem(
            "the program no-such-program-x is not in systemd's search path (/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin): give its absolute path"
        )]
    );
    assert_eq!(look(search("tool", &[&dir]), &RunAs::Root), []);
    one_problem_starting(
        look(search("plain", &[&dir]), &RunAs::Root),
        "the program plain is not in systemd's search path",
    );
}

/// Whether the kernel runs `path` (exit status 0), as execve(2) does it, without a shell's
/// fallback for a file it refuses.
fn kernel_runs(path: &str) -> bool {
    std::process::Command::new(path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn a_script_passes_where_the_kernel_runs_it_and_only_there() {
    let d = open_dir();
    let p = |n: &str| d.path().join(n);
    let long_arg = format!("#!/bin/sh -e{}\nexit 0\n", " ".repeat(300));
    let long_name = format!("#!/{}\nexit 0\n", "a".repeat(300));
    let mut cases: Vec<(String, Vec<u8>)> = [
        ("plain", "#!/bin/sh\nexit 0\n"),
        ("crlf", "#!/bin/sh\r\nexit 0\r\n"),
        ("blanks", "#! \t/bin/sh \t\nexit 0\n"),
        ("argument", "#!/bin/sh -e\nexit 0\n"),
        ("nothing", "#!\nexit 0\n"),
        ("only-blanks", "#! \t \nexit 0\n"),
        ("long-argument", &long_arg),
        ("long-name", &long_name),
        ("nul", "#!/bin/sh\0x\nexit 0\n"),
        ("just-the-mark", "#!"),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_string(), t.as_bytes().to_vec()))
    .collect();
    // Scripts run by scripts: `chain-N` is N scripts, each the interpreter of the one before.
    for n in 1..=7 {
        for i in 0..n {
            let next = if i + 1 == n { s("/bin/sh") } else { p(&format!("chain-{n}.{}", i + 1)).display().to_string() };
            write(&p(&format!("chain-{n}.{i}")), format!("#!{next}\nexit 0\n").as_bytes(), 0o755);
        }
        cases.push((format!("chain-{n}.0"), Vec::new()));
    }
    let mut ran = Vec::new();
    for (name, text) in &cases {
        if !text.is_empty() {
            write(&p(name), text, 0o755);
        }
        let path = p(name).display().to_string();
        let kernel = kernel_runs(&path);
        let looked = look_program(&Program::Path(path.clone()), &RunAs::Root);
        assert_eq!(looked.is_empty(), kernel, "{name}: the kernel runs it: {kernel}; the look: {looked:?}");
        if kernel {
            ran.push(name.as_str());
        }
    }
    // What this kernel did, for the record of what the look follows.
    assert_eq!(
        ran,
        [
            "plain",
            "blanks",
            "argument",
            "long-argument",
            "nul",
            "chain-1.0",
            "chain-2.0",
            "chain-3.0",
            "chain-4.0",
            "chain-5.0"
        ]
    );
    let chain = |n: usize, i: usize| p(&format!("chain-{n}.{i}")).display().to_string();
    let said: String = (1..6).map(|i| format!(" is a script whose interpreter {}", chain(6, i))).collect();
    assert_eq!(
        look_program(&Program::Path(chain(6, 0)), &RunAs::Root),
        [problem(format!(
            "the program {}{said} is a script too: the kernel follows at most 5 interpreters (ELOOP)",
            chain(6, 0)
        ))]
    );
    let crlf = p("crlf").display().to_string();
    assert_eq!(
        look_program(&Program::Path(crlf.clone()), &RunAs::Root),
        [problem(format!(
            "the program {crlf} is a script whose interpreter \"/bin/sh\\r\" does not exist: its first line ends in a carriage return (Windows line endings), which the kernel reads as part of the interpreter's name"
        ))]
    );
}

#[test]
fn models_are_checked_in_their_engine_s_form() {
    let d = open_dir();
    let p = |n: &str| d.path().join(n);
    let hf = mkdir(&p("hf"), 0o755);
    write(&p("hf/config.json"), b"{}", 0o644);
    write(&p("hf/model.safetensors"), b"\x08\x00", 0o644);
    let bare = mkdir(&p("bare"), 0o755);
    let mistral = mkdir(&p("mistral"), 0o755);
    write(&p("mistral/params.json"), b"{}", 0o644);
    let gguf = write(&p("m.gguf"), b"GGUF\x03\x00\x00\x00", 0o644);
    let elf = write(&p("elf.gguf"), b"\x7fELF\x02", 0o644);
    let empty = write(&p("empty.gguf"), b"", 0o644);
    let text = write(&p("notes.txt"), b"hello", 0o644);
    let root = Cwd::Path(s("/"));
    let look = |role, v: &str, form, cwd: &Cwd| look_model(role, v, form, cwd, &RunAs::Root);
    use ModelForm::{FolderOrGguf, GgufFile};
    use ModelRole::{Draft, Model};
    assert_eq!(look(Model, &hf, FolderOrGguf, &root), []);
    assert_eq!(look(Model, &gguf, FolderOrGguf, &root), []);
    assert_eq!(look(Draft, &gguf, GgufFile, &root), []);
    assert_eq!(
        look(Draft, &bare, FolderOrGguf, &root),
        [problem(format!("the draft model {bare} has no config.json: not a Hugging Face model folder"))]
    );
    assert_eq!(
        look(Model, &mistral, FolderOrGguf, &root),
        [Found::Note(format!(
            "not checked: the model {mistral} has no config.json but a params.json (Mistral's format)"
        ))]
    );
    assert_eq!(
        look(Model, &hf, GgufFile, &root),
        [problem(format!("the model {hf} is a directory: llama-server loads one GGUF file"))]
    );
    assert_eq!(
        look(Model, &elf, GgufFile, &root),
        [problem(format!("the model {elf} is not a GGUF file (it starts with 0x7f454c46)"))]
    );
    assert_eq!(
        look(Model, &elf, FolderOrGguf, &root),
        [problem(format!(
            "the model {elf} is not a GGUF file nor a Hugging Face model folder (it starts with 0x7f454c46)"
        ))]
    );
    assert_eq!(
        look(Draft, &empty, GgufFile, &root),
        [problem(format!("the draft model {empty} is not a GGUF file (it is empty)"))]
    );
    assert_eq!(
        look(Model, &text, GgufFile, &root),
        [problem(format!("the model {text} is not a GGUF file (it starts with \"hell\")"))]
    );
    let gone = p("no-such-draft").display().to_string();
    assert_eq!(look(Draft, &gone, FolderOrGguf, &root), [problem(format!("the draft model {gone} does not exist"))]);
    // Not a path: a repo id the engine downloads, unless the working directory has it.
    assert_eq!(
        look(Model, "Qwen/Qwen3-8B", FolderOrGguf, &root),
        [Found::Note(s(
            "not checked: the model Qwen/Qwen3-8B is a Hugging Face repo id; the engine downloads it at start"
        ))]
    );
    assert_eq!(
        look(Model, "Qwen/Qwen3-8B", GgufFile, &root),
        [problem("the model Qwen/Qwen3-8B does not exist (looked for at /Qwen/Qwen3-8B)")]
    );
    assert_eq!(
        look(Model, "~/m.gguf", GgufFile, &root),
        [problem(
            "the model ~/m.gguf does not exist (looked for at /~/m.gguf; systemd does not expand ~ in a command line)"
        )]
    );
    let here = Cwd::Path(d.path().display().to_string());
    assert_eq!(look(Model, "hf", FolderOrGguf, &here), []);
    assert_eq!(
        look(Model, "bare", FolderOrGguf, &here),
        [problem(format!("the model {bare} has no config.json: not a Hugging Face model folder"))]
    );
}

#[test]
fn files_the_engine_never_reads_do_not_refuse_a_model() {
    let d = open_dir();
    let p = |n: &str| d.path().join(n);
    let m = mkdir(&p("m"), 0o755);
    write(&p("m/config.json"), b"{}", 0o644);
    write(&p("m/model.safetensors"), b"x", 0o644);
    write(&p("m/tokenizer.json"), b"{}", 0o644);
    // Root's own README and training leftovers, a link to nothing among the notes.
    write(&p("m/README.md"), b"x", 0o600);
    write(&p("m/training_args.bin"), b"x", 0o600);
    std::os::unix::fs::symlink("../gone", p("m/notes.txt")).unwrap();
    let look = |as_: &RunAs| look_model(ModelRole::Model, &m, ModelForm::FolderOrGguf, &Cwd::Path(s("/")), as_);
    let got = look(&nobody());
    assert!(!got.iter().any(|f| matches!(f, Found::Problem(_))), "{got:?}");
    assert!(
        matches!(&got[..], [Found::Note(a), Found::Note(b)]
            if a.starts_with(&format!("user nobody cannot read README.md and 1 more in the model {m} (mode 0600, owner "))
                && a.ends_with("; the engine does not read them")
                && *b == format!("notes.txt in the model {m} is a symbolic link to nothing; the engine does not read it")),
        "{got:?}"
    );
    // What the engine does read still refuses it.
    write(&p("m/tokenizer.json"), b"{}", 0o600);
    std::os::unix::fs::symlink("../gone", p("m/model-00002.safetensors")).unwrap();
    let got = look(&nobody());
    let problems: Vec<&Found> = got.iter().filter(|f| matches!(f, Found::Problem(_))).collect();
    assert!(
        matches!(&problems[..], [Found::Problem(a), Found::Problem(b)]
            if a.starts_with(&format!("user nobody cannot read tokenizer.json in the model {m} (mode 0600, owner "))
                && *b == format!("model-00002.safetensors in the model {m} is a symbolic link to nothing")),
        "{got:?}"
    );
}

/// A root directory standing for the host's (`/proc/1/root`), with `path` written under it.
fn host_file(root: &Path, path: &str, bytes: &[u8]) {
    let at = root.join(path.trim_start_matches('/'));
    std::fs::create_dir_all(at.parent().unwrap()).unwrap();
    std::fs::write(at, bytes).unwrap();
}

#[test]
fn files_are_looked_at_in_the_host_s_view_where_specd_s_own_differs() {
    let host = open_dir();
    let s_ = Sight::Through(host.path().to_path_buf());
    let none = Sandbox::default();
    // Only the host's /tmp and /var/tmp have them: not this process's.
    let (model, env) = ("/tmp/specd-preflight-host-only/m.gguf", "/var/tmp/specd-preflight-host-only/env");
    assert!(!Path::new(model).exists() && !Path::new(env).exists());
    host_file(host.path(), model, b"GGUF\x03\x00\x00\x00");
    host_file(host.path(), env, b"A=1\n");
    host_file(host.path(), "/srv/models/real.gguf", b"GGUF");
    std::os::unix::fs::symlink("/srv/models/real.gguf", host.path().join("tmp/specd-preflight-host-only/link.gguf"))
        .unwrap();
    let root = Cwd::Path(s("/"));
    let look =
        |v: &str| super::files::look_model(&s_, ModelRole::Model, v, ModelForm::GgufFile, &root, &RunAs::Root, &none);
    assert_eq!(look(model), []);
    // An absolute link leads within the host's root, not into specd's own /srv.
    assert_eq!(look("/tmp/specd-preflight-host-only/link.gguf"), []);
    assert_eq!(
        look("/tmp/specd-preflight-host-only/gone.gguf"),
        [problem("the model /tmp/specd-preflight-host-only/gone.gguf does not exist")]
    );
    assert_eq!(super::files::look_environment_file(&s_, env, false), []);
    assert_eq!(super::files::look_credential(&s_, "tok", env), []);
    // The same looks in specd's own view do not find them.
    let own =
        super::files::look_model(&Sight::Own, ModelRole::Model, model, ModelForm::GgufFile, &root, &RunAs::Root, &none);
    assert_eq!(own, [problem(format!("the model {model} does not exist"))]);
    // Where specd cannot look at the host's view, what it does not find there is a note.
    let blind = Sight::Blind {
        dirs: vec![PathBuf::from("/tmp"), PathBuf::from("/var/tmp")],
        why: s("/proc/1/root: Permission denied"),
    };
    let found = super::files::look_environment_file(&blind, env, false);
    assert_eq!(
        found,
        [Found::Note(format!(
            "not checked from here: specd's own view of /var/tmp differs from the unit's (specd runs in a mount namespace of its own: its unit's PrivateTmp=, ProtectHome= or the like), and it cannot look at the host's (/proc/1/root: Permission denied); in specd's own view, the environment file {env} does not exist"
        ))]
    );
    let elsewhere = super::files::look_model(
        &blind,
        ModelRole::Model,
        "/srv/nowhere.gguf",
        ModelForm::GgufFile,
        &root,
        &RunAs::Root,
        &none,
    );
    assert_eq!(elsewhere, [problem("the model /srv/nowhere.gguf does not exist")], "outside the dirs that differ");
}

#[test]
fn what_the_unit_s_sandbox_hides_from_its_server_refuses_it() {
    let d = open_dir();
    let p = |n: &str| d.path().join(n).display().to_string();
    let tmp = mkdir(Path::new(&p("tmp")), 0o1777);
    let model = write(Path::new(&format!("{tmp}/m.gguf")), b"GGUF", 0o644);
    let link = p("models-link.gguf");
    std::os::unix::fs::symlink(&model, &link).unwrap();
    let setting = "PrivateTmp=yes (in /etc/systemd/system/service.d/tmp.conf)";
    let hidden = Sandbox { hidden: vec![Shadow { dir: tmp.clone(), setting: s(setting) }], elsewhere: vec![] };
    let root = Cwd::Path(s("/"));
    let look = |v: &str, sb: &Sandbox| {
        super::files::look_model(&Sight::Own, ModelRole::Model, v, ModelForm::GgufFile, &root, &RunAs::Root, sb)
    };
    assert_eq!(look(&model, &Sandbox::default()), []);
    let said =
        format!("is under {tmp}, which the unit's {setting} hides from its server: the server would not find it there");
    assert_eq!(look(&model, &hidden), [problem(format!("the model {model} {said}"))]);
    assert_eq!(look(&link, &hidden), [problem(format!("the model {link} (it leads to {model}) {said}"))]);
    // The program and its working directory too; not what systemd reads before the sandbox.
    let program = Program::Path(format!("{tmp}/server"));
    write(Path::new(&format!("{tmp}/server")), b"\x7fELF", 0o755);
    assert_eq!(
        super::program::look_program(&Sight::Own, &program, &RunAs::Root, &hidden),
        [problem(format!("the program {tmp}/server {said}"))]
    );
    let wd = super::files::look_working_directory(&Sight::Own, &Cwd::Path(tmp.clone()), false, &RunAs::Root, &hidden);
    assert_eq!(wd, [problem(format!("the working directory {tmp} {said}"))]);
    assert_eq!(super::files::look_environment_file(&Sight::Own, &model, false), []);
    // A script whose interpreter the sandbox hides.
    let script = write(Path::new(&p("script")), format!("#!{tmp}/server\n").as_bytes(), 0o755);
    assert_eq!(
        super::program::look_program(&Sight::Own, &Program::Path(script.clone()), &RunAs::Root, &hidden),
        [problem(format!("the program {script} is a script whose interpreter {tmp}/server {said}"))]
    );
    // Another file system shown there: not checked.
    let bound =
        Sandbox { hidden: vec![], elsewhere: vec![Shadow { dir: tmp.clone(), setting: s("BindPaths=/srv:/tmp") }] };
    assert_eq!(
        look(&format!("{tmp}/other.gguf"), &bound),
        [Found::Note(format!(
            "not checked: the model {tmp}/other.gguf is under {tmp}, where the unit's BindPaths=/srv:/tmp shows its server other files than the host's"
        ))],
        "what the host has at that path is not what the server finds"
    );
    assert_eq!(
        look(&model, &bound),
        [Found::Note(format!(
            "not checked: the model {model} is under {tmp}, where the unit's BindPaths=/srv:/tmp shows its server other files than the host's"
        ))]
    );
}

#[test]
fn a_model_its_user_cannot_read_is_named() {
    let d = open_dir();
    let p = |n: &str| d.path().join(n);
    let private = mkdir(&p("private"), 0o700);
    write(&p("private/config.json"), b"{}", 0o644);
    let locked = mkdir(&p("locked"), 0o755);
    write(&p("locked/config.json"), b"{}", 0o644);
    write(&p("locked/model-00001.safetensors"), b"x", 0o600);
    write(&p("locked/model-00002.safetensors"), b"x", 0o600);
    let no_entry = mkdir(&p("no-entry"), 0o744);
    write(&p("no-entry/config.json"), b"{}", 0o644);
    let gated = mkdir(&p("gated"), 0o700);
    let inner = write(&p("gated/m.gguf"), b"GGUF", 0o644);
    let links = mkdir(&p("links"), 0o755);
    write(&p("links/config.json"), b"{}", 0o644);
    std::os::unix::fs::symlink("../blobs/gone", p("links/model.safetensors")).unwrap();
    let root = Cwd::Path(s("/"));
    let look = |v: &str, form, as_: &RunAs| look_model(ModelRole::Model, v, form, &root, as_);
    let folder = ModelForm::FolderOrGguf;
    for as_ in [nobody(), RunAs::Dynamic] {
        let who = if as_ == RunAs::Dynamic { "the unit's dynamic user" } else { "user nobody" };
        one_problem_starting(
            look(&private, folder, &as_),
            &format!("{who} cannot read the model {private} (mode 0700, owner "),
        );
        one_problem_starting(
            look(&locked, folder, &as_),
            &format!("{who} cannot read model-00001.safetensors and 1 more in the model {locked} (mode 0600, owner "),
        );
        one_problem_starting(
            look(&no_entry, folder, &as_),
            &format!("{who} cannot enter the model {no_entry} (mode 0744, owner "),
        );
        let m = one_problem_starting(
            look(&inner, ModelForm::GgufFile, &as_),
            &format!("{who} cannot enter {gated} (mode 0700, owner "),
        );
        assert!(m.ends_with(&format!("), which holds the model {inner}")), "{m}");
    }
    // Root reads everything.
    for v in [&private, &locked, &no_entry] {
        assert_eq!(look(v, folder, &RunAs::Root), [], "{v}");
    }
    assert_eq!(
        look(&links, folder, &RunAs::Root),
        [problem(format!("model.safetensors in the model {links} is a symbolic link to nothing"))]
    );
}

#[test]
fn systemd_reads_environment_files_and_credentials_as_root() {
    let d = open_dir();
    let p = |n: &str| d.path().join(n).display().to_string();
    let secret = write(&d.path().join("env"), b"HF_TOKEN=x\n", 0o600);
    let gone = p("gone");
    assert_eq!(look_environment_file(&secret, false), []);
    assert_eq!(look_environment_file(&gone, true), []);
    assert_eq!(look_environment_file(&gone, false), [problem(format!("the environment file {gone} does not exist"))]);
    let dir = p("");
    let dir = dir.trim_end_matches('/');
    assert_eq!(look_environment_file(dir, true), [problem(format!("the environment file {dir} is a directory"))]);
    // Root reads a file whatever its mode; specd not root can only say it could not.
    let shut = write(&d.path().join("shut"), b"A=1\n", 0o000);
    let got = look_environment_file(&shut, false);
    if nix::unistd::geteuid().is_root() {
        assert_eq!(got, []);
    } else {
        assert!(
            matches!(&got[..], [Found::Note(m)] if m.ends_with("(specd is not root; systemd reads it as root)")),
            "{got:?}"
        );
    }
    assert_eq!(look_credential("hf_token", &secret), []);
    assert_eq!(look_credential("keys", dir), [], "a directory of credentials");
    assert_eq!(
        look_credential("hf_token", &gone),
        [problem(format!("the credential hf_token's file {gone} does not exist"))]
    );
}

#[test]
fn users_and_groups_must_exist() {
    for u in ["root", "nobody", "0"] {
        assert_eq!(look_user(u), [], "{u}");
    }
    assert_eq!(
        look_user("no-such-user-x"),
        [problem("the user no-such-user-x does not exist on this host (User=no-such-user-x)")]
    );
    assert_eq!(look_user("3999999999"), [problem("the user 3999999999 does not exist on this host (User=3999999999)")]);
    assert_eq!(look_group("root"), []);
    assert_eq!(
        look_group("no-such-group-x"),
        [problem("the group no-such-group-x does not exist on this host (Group=no-such-group-x)")]
    );
    assert!(matches!(who(&nobody()), Some(Who::Ids { uid: 65534, .. })));
    assert!(matches!(who(&RunAs::User { user: s("root"), group: None }), Some(Who::Root)));
    assert!(who(&RunAs::User { user: s("no-such-user-x"), group: None }).is_none());
    assert!(who(&RunAs::User { user: s("nobody"), group: Some(s("no-such-group-x")) }).is_none());
}

#[test]
fn a_working_directory_must_exist_and_be_entered() {
    let d = open_dir();
    let gone = d.path().join("gone").display().to_string();
    let file = write(&d.path().join("file"), b"", 0o644);
    let closed = mkdir(&d.path().join("closed"), 0o700);
    let look = |dir: &str, optional, as_: &RunAs| look_working_directory(&Cwd::Path(s(dir)), optional, as_);
    assert_eq!(look(&gone, false, &RunAs::Root), [problem(format!("the working directory {gone} does not exist"))]);
    assert_eq!(
        look(&gone, true, &RunAs::Root),
        [Found::Note(format!("the working directory {gone} does not exist (optional: the server starts without it)"))]
    );
    assert_eq!(look(&file, false, &RunAs::Root), [problem(format!("the working directory {file} is not a directory"))]);
    assert_eq!(look(&closed, false, &RunAs::Root), []);
    one_problem_starting(
        look(&closed, false, &nobody()),
        &format!("user nobody cannot enter the working directory {closed} (mode 0700, owner "),
    );
    assert_eq!(look_working_directory(&Cwd::Home, false, &RunAs::Root), []);
    assert_eq!(look_working_directory(&Cwd::Home, false, &RunAs::User { user: s("no-such-user-x"), group: None }), []);
}

#[test]
fn the_port_must_be_free_or_held_by_the_unit_s_own_instance() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let me = std::process::id();
    let m = one_problem_starting(
        look_port("x.service", "127.0.0.1", port, ""),
        &format!("port {port} is held by pid {me} ("),
    );
    assert!(m.ends_with(&format!("), which is not part of x.service (it listens on 127.0.0.1:{port})")), "{m}");
    let argv0 = std::env::args().next().unwrap();
    assert!(m.contains(&argv0), "{m} names the command line");
    assert_eq!(look_port("x.service", "0.0.0.0", port, "").len(), 1, "a wildcard takes the port too");
    assert_eq!(look_port("x.service", "127.0.0.2", port, ""), [], "another address");
    // The unit's own instance is about to be stopped.
    let own = cgroup_of(me).unwrap();
    assert_eq!(look_port("x.service", "127.0.0.1", port, &own), []);
    drop(l);
    // A process another test spawns holds a copy of the socket from its fork to its exec
    // (where close-on-exec drops it): the port is free once none does, within a bound.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut found = look_port("x.service", "127.0.0.1", port, "");
    while !found.is_empty() && std::time::Instant::now() < deadline {
        std::thread::yield_now();
        found = look_port("x.service", "127.0.0.1", port, "");
    }
    assert_eq!(found, []);
}

#[test]
fn gpus_named_by_index_must_exist() {
    let d = open_dir();
    let dev = d.path().display().to_string();
    assert_eq!(
        look_gpus(&[0, 1], d.path()),
        [Found::Note(format!(
            "not checked: CUDA_VISIBLE_DEVICES names GPU 0,1, and this host shows no NVIDIA device ({dev}/nvidia0 …)"
        ))]
    );
    for n in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps"] {
        write(&d.path().join(n), b"", 0o666);
    }
    assert_eq!(look_gpus(&[0, 1], d.path()), []);
    assert_eq!(
        look_gpus(&[1, 2, 3], d.path()),
        [problem(format!(
            "CUDA_VISIBLE_DEVICES names GPU 2, 3, but this host has 2 NVIDIA GPUs ({dev}/nvidia0, {dev}/nvidia1)"
        ))]
    );
}

#[tokio::test]
async fn systemd_analyze_verify_reads_the_unit_as_systemd_does() {
    let host = Machine::seeing(Sight::Own);
    let unit = "verify-me.service";
    let spec = resolve(&format!("  unit: {unit}\n  engine: vllm\n  command: [/bin/sh]\n  model: /models/m\n"));
    let text = specd_spec::render(&spec).text;
    assert_eq!(verify(unit, &text, &host).await, []);
    let bad = text.replace("Type=exec\n", "Type=exec\nBogusKey=1\n");
    let m = one_problem_starting(verify(unit, &bad, &host).await, &format!("systemd-analyze verify: {unit}:"));
    assert!(m.contains("BogusKey"), "{m}");
    let missing = text.replace("ExecStart=/bin/sh", "ExecStart=/opt/nowhere/vllm");
    assert_eq!(
        verify(unit, &missing, &host).await,
        [problem(format!(
            "systemd-analyze verify: {unit}: Command /opt/nowhere/vllm is not executable: No such file or directory"
        ))]
    );
}

#[tokio::test]
async fn without_systemd_analyze_or_when_it_hangs_the_unit_is_not_checked() {
    let gone = Machine { analyze: vec![s("/no/such/systemd-analyze")], ..Machine::seeing(Sight::Own) };
    assert_eq!(
        verify("a.service", "", &gone).await,
        [Found::Note(s("not checked: /no/such/systemd-analyze is not installed"))]
    );
    let d = open_dir();
    let pid_file = d.path().join("pid");
    let hang = format!("echo $$ > {}; exec sleep 600", pid_file.display());
    let hung = Machine {
        analyze: vec![s("sh"), s("-c"), hang, s("sh")],
        verify_within: Duration::from_millis(300),
        ..Machine::seeing(Sight::Own)
    };
    assert_eq!(
        verify("a.service", "", &hung).await,
        [Found::Note(s("not checked: sh verify did not finish within 0.3 s"))]
    );
    // It was killed, not left behind.
    let pid: u32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    let exit = crate::machine::process::exited(pid, None).expect("a pidfd");
    tokio::time::timeout(Duration::from_secs(10), exit).await.expect("the hung verify was killed");
}

#[tokio::test]
async fn a_spec_that_cannot_start_is_refused_before_any_stop() {
    let d = open_dir();
    let model = mkdir(&d.path().join("model"), 0o755);
    write(&d.path().join("model/config.json"), b"{}", 0o644);
    let draft = d.path().join("no-such-draft").display().to_string();
    // The port is held by the unit's old instance (this process, in the unit's cgroup).
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let own = cgroup_of(std::process::id()).unwrap();
    let spec = resolve(&format!(
        "  unit: vllm-llama.service\n  engine: vllm\n  command: [/opt/nowhere/vllm, serve]\n  model: {model}\n  server: {{port: {port}}}\n  speculative: {{algorithm: eagle, draft_model: {draft}, num_steps: 3}}\n"
    ));
    let out = run(&checks(&spec, &specd_spec::render(&spec).text, &[]), &own).await;
    let p = |check, m: &str| Problem { check, message: s(m) };
    assert_eq!(
        out.problems,
        [
            p(CheckKind::Program, "the program /opt/nowhere/vllm does not exist"),
            p(CheckKind::DraftModel, &format!("the draft model {draft} does not exist")),
            p(
                CheckKind::UnitFile,
                "systemd-analyze verify: vllm-llama.service: Command /opt/nowhere/vllm is not executable: No such file or directory"
            ),
        ]
    );
    assert_eq!(out.notes, []);
    assert!(!out.passed());
    assert_eq!(
        summary(&out.problems),
        format!(
            "the program /opt/nowhere/vllm does not exist; the draft model {draft} does not exist; systemd-analyze verify: vllm-llama.service: Command /opt/nowhere/vllm is not executable: No such file or directory"
        )
    );
    // The same with the program and the draft there, run by nobody: it passes, with
    // systemd's warning about that user as a note.
    let draft = mkdir(&d.path().join("draft"), 0o755);
    write(&d.path().join("draft/config.json"), b"{}", 0o644);
    let spec = resolve(&format!(
        "  unit: vllm-llama.service\n  engine: vllm\n  command: [/bin/sh, serve]\n  model: {model}\n  server: {{port: {port}}}\n  speculative: {{algorithm: eagle, draft_model: {draft}, num_steps: 3}}\n  service: {{user: nobody}}\n"
    ));
    let out = run(&checks(&spec, &specd_spec::render(&spec).text, &[]), &own).await;
    assert!(out.passed(), "{out:?}");
    assert!(
        matches!(&out.notes[..], [Note { check: CheckKind::UnitFile, message }] if message.contains("Special user nobody configured")),
        "{out:?}"
    );
    drop(l);
}
