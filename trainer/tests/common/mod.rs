//! The runner the `harness = false` test binaries share (they serve as their own sandbox
//! workers, so they have their own `main`): runs each test, catching its panic, and prints
//! libtest's summary lines.

use std::panic::{AssertUnwindSafe, catch_unwind};

/// Runs `tests` in order and exits the process: status 1 when any failed.
pub fn run_tests(tests: &[(&str, fn())]) -> ! {
    let plural = if tests.len() == 1 { "" } else { "s" };
    println!("\nrunning {} test{plural}", tests.len());
    let mut failed = 0;
    for &(name, test) in tests {
        let ok = catch_unwind(AssertUnwindSafe(test)).is_ok();
        println!("test {name} ... {}", if ok { "ok" } else { "FAILED" });
        failed += usize::from(!ok);
    }
    let passed = tests.len() - failed;
    let verdict = if failed == 0 { "ok" } else { "FAILED" };
    println!(
        "\ntest result: {verdict}. {passed} passed; {failed} failed; 0 ignored; 0 measured; 0 filtered out\n"
    );
    std::process::exit(i32::from(failed > 0));
}
