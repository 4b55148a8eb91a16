//! Links this crate's binaries, tests and benchmarks with an rpath to the directory of the
//! `libpython` that PyO3 builds against (so sandbox workers start without
//! `LD_LIBRARY_PATH`), and records that interpreter's `sys.base_prefix` as
//! `FATHOM_PYTHON_HOME`, which workers pass to CPython as its home so that the standard
//! library always matches the linked `libpython` (another Python installed on the machine,
//! e.g. Debian's `/usr/lib/python3.11`, must not be picked up).

use std::process::Command;

fn main() {
    pyo3_build_config::add_libpython_rpath_link_args();
    let config = pyo3_build_config::get();
    let executable = config
        .executable()
        .map(str::to_string)
        .unwrap_or_else(|| "python3".into());
    let output = Command::new(&executable)
        .args(["-I", "-c", "import sys; print(sys.base_prefix, end='')"])
        .output();
    match output {
        Ok(out) if out.status.success() => {
            let home = String::from_utf8_lossy(&out.stdout).into_owned();
            println!("cargo:rustc-env=FATHOM_PYTHON_HOME={home}");
        }
        _ => panic!(
            "cannot ask {executable} for its sys.base_prefix (set PYO3_PYTHON to a Python 3.11+)"
        ),
    }
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
}
