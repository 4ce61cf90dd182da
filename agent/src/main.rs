fn main() -> std::process::ExitCode {
    specd::cli::main()
}
