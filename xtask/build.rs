//! xtask serves as its own sandbox worker (it embeds CPython through `fathom-env`), so it is
//! linked with an rpath to the `libpython` PyO3 builds against.

fn main() {
    pyo3_build_config::add_libpython_rpath_link_args();
}
