fn main() -> std::process::ExitCode {
    specd::main()
}
