//! `fathom-sandbox`: the sandbox worker binary. The parent starts it with the worker marker
//! argument; run by hand it only says what it is.

fn main() {
    fathom_env::sandbox::run_worker_if_requested();
    eprintln!(
        "fathom-sandbox is Fathom's sandbox worker; it is started by the environment, not by hand."
    );
    std::process::exit(2);
}
