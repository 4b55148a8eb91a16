//! The trainer links `fathom-env`, which embeds CPython, so its tests (which run the real
//! environment and serve as their own sandbox workers) are linked with an rpath to the
//! `libpython` PyO3 builds against.

fn main() {
    pyo3_build_config::add_libpython_rpath_link_args();
}
