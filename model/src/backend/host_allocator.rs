//! Keeping freed host memory in the process for reuse, so the CPU backend's large activations
//! are not faulted in as fresh zeroed pages on every operation.
//!
//! glibc's `malloc` serves a block above its mmap threshold (128 KiB at first, raised at run time
//! as such blocks are freed, never above 32 MiB) with a mapping of its own, unmapped when the
//! block is freed, and returns the top of its heap to the kernel once more than twice that
//! threshold is free there. Every operation of the CPU backend allocates its output, so most
//! activations went back to the kernel when their tensor was dropped and came back, zeroed one
//! 4 KiB page at a time, at the next allocation: a QLoRA training step of the 1.5B shape
//! (1,024 tokens, `[1024, 8960]` f32 activations of 37 MB, above any mmap threshold) took three
//! to five million page faults and 9–11 s of system time per step. Served from the heap and kept
//! there for reuse, a run of it takes a fifth as many faults (a thirtieth with activation
//! checkpointing) and each step 10–13 % less time, and a 512-token prefill of the 0.5B shape
//! 13–14 % less time (docs/benchmarks.md, "The allocator"). Peak memory moved by under
//! 1 % (measured); what changes is that memory freed after a peak stays with the process, for its
//! next peak, instead of going back to the kernel.
//!
//! This module is for binaries to call at start-up; it changes nothing where the user already
//! configures glibc's allocator (`GLIBC_TUNABLES` with `glibc.malloc.*`, or the older
//! `MALLOC_*_` variables), and nothing on other C libraries.

/// How much free memory (bytes) at the top of a heap glibc keeps before returning it to the
/// kernel (a C `int`, as `mallopt` takes it).
pub const TRIM_THRESHOLD: i32 = 1 << 30;

/// The environment variables through which a user configures glibc's allocator.
const USER_SETTINGS: [&str; 5] = [
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_MAX_",
];

/// What [`keep_freed_memory`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostAllocator {
    /// glibc now serves blocks from its heaps rather than from mappings of their own (except a
    /// thread's blocks too large for a thread heap, 64 MiB) and keeps up to [`TRIM_THRESHOLD`]
    /// of free memory at a heap's top.
    Tuned,
    /// The user configures glibc's allocator through this environment variable, so nothing
    /// changed.
    UserSettings(String),
    /// glibc refused a setting (the name of it); the allocator keeps its defaults for it.
    Refused(&'static str),
    /// The process does not use glibc's allocator; nothing changed.
    NotGlibc,
}

/// Asks glibc's allocator to keep freed memory for reuse (see the module documentation). Call
/// it at start-up, before the process allocates heavily; it affects the whole process.
pub fn keep_freed_memory() -> HostAllocator {
    if let Some(name) = user_setting(|name| std::env::var(name).ok()) {
        return HostAllocator::UserSettings(name);
    }
    tune()
}

/// The first environment variable (read through `var`) by which the user configures glibc's
/// allocator.
fn user_setting(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    if var("GLIBC_TUNABLES").is_some_and(|t| t.contains("glibc.malloc.")) {
        return Some("GLIBC_TUNABLES".to_string());
    }
    USER_SETTINGS
        .iter()
        .find(|name| var(name).is_some())
        .map(|name| name.to_string())
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune() -> HostAllocator {
    // The trim threshold first: were the second refused, blocks would stay mapped (as by
    // default) rather than be kept in a heap that is then trimmed at once.
    let settings = [
        (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD, "M_TRIM_THRESHOLD"),
        (libc::M_MMAP_MAX, 0, "M_MMAP_MAX"),
    ];
    for (param, value, name) in settings {
        // SAFETY: mallopt only reads its two integer arguments; glibc serialises it against
        // concurrent allocation with the arena lock.
        if unsafe { libc::mallopt(param, value) } != 1 {
            return HostAllocator::Refused(name);
        }
    }
    HostAllocator::Tuned
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune() -> HostAllocator {
    HostAllocator::NotGlibc
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// Minor page faults of the calling thread so far.
    fn thread_faults() -> i64 {
        // SAFETY: getrusage writes into the zeroed struct it is given.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: a valid pointer to a rusage struct.
        assert_eq!(
            unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) },
            0
        );
        usage.ru_minflt
    }

    #[test]
    fn freed_blocks_are_reused_without_page_faults() {
        // Sixteen rounds of three 12 MiB blocks allocated, written and freed, as an operation's
        // temporaries are. Under glibc's defaults the freed 36 MiB at the heap's top exceed the
        // trim threshold (twice the 12 MiB the mmap threshold rose to), go back to the kernel
        // and fault in again every round (~147,000 faults); kept, only the first round faults.
        // (Blocks over 32 MiB would stay mapped under the defaults whatever the trim threshold.)
        // `tune` rather than `keep_freed_memory`, so a user's allocator settings in the
        // environment do not change what is measured.
        assert_eq!(tune(), HostAllocator::Tuned);
        let faults = rounds_faults(3, 12 << 20);
        assert!(
            faults < 6 * 3072,
            "{faults} page faults for 16 rounds of three reused 12 MiB blocks"
        );
        // One 40 MiB block a round: above the largest mmap threshold, so by default mapped and
        // unmapped every round (~164,000 faults).
        let faults = rounds_faults(1, 40 << 20);
        assert!(
            faults < 2 * 10240,
            "{faults} page faults for 16 rounds of a reused 40 MiB block"
        );
    }

    /// Page faults of sixteen rounds of `count` blocks of `len` bytes allocated, written a byte
    /// per page, and freed.
    fn rounds_faults(count: usize, len: usize) -> i64 {
        let before = thread_faults();
        for round in 0..16u8 {
            let mut blocks: Vec<Vec<u8>> = (0..count).map(|_| vec![round; len]).collect();
            for block in &mut blocks {
                for byte in block.iter_mut().step_by(4096) {
                    *byte = byte.wrapping_add(1);
                }
            }
            std::hint::black_box(&blocks);
        }
        thread_faults() - before
    }

    #[test]
    fn user_settings_are_found_in_the_environment() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(user_setting(env(&[])), None);
        assert_eq!(
            user_setting(env(&[("GLIBC_TUNABLES", "glibc.rtld.nns=2")])),
            None
        );
        assert_eq!(
            user_setting(env(&[("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")])),
            Some("GLIBC_TUNABLES".to_string())
        );
        assert_eq!(
            user_setting(env(&[("MALLOC_ARENA_MAX", "2")])),
            Some("MALLOC_ARENA_MAX".to_string())
        );
    }
}
