//! A global allocator that asks Linux for transparent huge pages (2 MiB) on
//! large allocations: weights and activations of a few MB and up.
//!
//! Why: with 4 KiB pages, decoding (which streams every weight once per
//! token) spends its time on TLB misses as well as DRAM reads, and every
//! fresh activation buffer costs 512 page faults per 2 MiB. Measured on this
//! project's benchmark machine: a streaming read runs ~10 % faster on huge
//! pages. Most systems ship THP in `madvise` mode, so it has to be asked for;
//! where THP is off, the advice is ignored and nothing changes.
//!
//! The `tokenformer` binary installs it; a library user opts in with
//! `#[global_allocator] static A: tokenformer::alloc::HugePages = tokenformer::alloc::HugePages;`.
//!
//! [`keep_freed_memory`] (also called by the binary) stops glibc from handing
//! freed activations back to the kernel, so the next forward pass reuses
//! pages that are already mapped instead of faulting in and zeroing new ones.

use std::alloc::{GlobalAlloc, Layout, System};

/// Allocations at least this large are advised (smaller ones come from the
/// malloc heap, whose pages are shared with other objects).
const HUGE_FROM: usize = 4 << 20;

/// [`System`] plus `madvise(MADV_HUGEPAGE)` on large blocks before first use.
pub struct HugePages;

fn advise(ptr: *mut u8, size: usize) {
    #[cfg(target_os = "linux")]
    if size >= HUGE_FROM && !ptr.is_null() {
        const PAGE: usize = 4096;
        let start = (ptr as usize).next_multiple_of(PAGE);
        let end = (ptr as usize + size) / PAGE * PAGE;
        // SAFETY: the range lies inside the block just allocated; advice
        // changes how its pages are backed, never their contents.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, size);
}

/// Asks glibc's malloc to keep freed memory for reuse: no trimming of the
/// heap top and no `mmap` for large blocks (which `free` would unmap).
///
/// Why: a forward pass frees tens to hundreds of MB of activations (the
/// logits alone are 412 MB at 2048 tokens) that the next pass allocates
/// again. By default glibc returns them to the kernel, which then faults in
/// and zeroes the same amount again: on the benchmark machine that was
/// 3 s of system time in a prefill benchmark and ~20 % of prefill
/// throughput. The cost is that resident memory stays at its high-water
/// mark (what PyTorch's caching allocators do too); `malloc_trim(0)` still
/// releases it on demand. Returns whether malloc took both settings (false
/// off glibc, where this does nothing).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // -1 (as size_t: the largest size) turns trimming off, as mallopt(3) documents:
        // a finite threshold below the working set (training the `small` model keeps
        // ~2.8 GB) lets one large free hand the heap top back, and the next step faults
        // it in again page by page.
        const NO_TRIM: libc::c_int = -1;
        // 1 GiB: above any activation (2048 tokens of logits are 412 MB). glibc 2.36
        // takes it (mallopt returns 1); older ones capped it at 32 MiB and refused.
        const NO_MMAP_BELOW: libc::c_int = 1 << 30;
        // SAFETY: mallopt only changes malloc's tuning parameters.
        unsafe {
            libc::mallopt(libc::M_TRIM_THRESHOLD, NO_TRIM) == 1
                && libc::mallopt(libc::M_MMAP_THRESHOLD, NO_MMAP_BELOW) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

// SAFETY: every call is forwarded to `System`; `advise` only adds a hint.
unsafe impl GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        advise(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        advise(p, layout.size());
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        advise(p, new_size);
        p
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn anon_huge_kb() -> u64 {
        let s = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with("AnonHugePages:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0)
    }

    #[test]
    fn large_blocks_get_huge_pages_when_the_kernel_offers_them() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        let size = 64 << 20;
        let layout = Layout::from_size_align(size, 64).unwrap();
        let before = anon_huge_kb();
        // SAFETY: a valid non-zero layout; the block is written within bounds and freed.
        unsafe {
            let p = HugePages.alloc(layout);
            assert!(!p.is_null());
            std::ptr::write_bytes(p, 1, size);
            let gained = anon_huge_kb().saturating_sub(before);
            assert_eq!(*p.add(size - 1), 1);
            HugePages.dealloc(p, layout);
            if thp.contains("[always]") || thp.contains("[madvise]") {
                // Most of 64 MiB (all but the unaligned ends) is huge pages.
                assert!(gained >= 48 << 10, "only {gained} kB of huge pages");
            }
        }
    }

    /// Minor page faults of the calling thread so far.
    fn thread_faults() -> i64 {
        // SAFETY: getrusage fills the zeroed struct it is given.
        unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut u);
            u.ru_minflt
        }
    }

    /// Allocates `size` bytes, writes every page, frees; returns the faults.
    fn touch_and_free(size: usize) -> i64 {
        let before = thread_faults();
        let v = std::hint::black_box(vec![1u8; size]);
        assert_eq!(v[size - 1], 1);
        drop(v);
        thread_faults() - before
    }

    #[cfg(target_env = "gnu")]
    #[test]
    fn freed_blocks_are_reused_without_new_page_faults() {
        // 48 MB is above glibc's largest automatic mmap threshold (32 MB), so
        // by default every such block is a fresh mapping: ~12k faults each.
        let size = 48 << 20;
        assert!(keep_freed_memory());
        touch_and_free(size);
        let again = touch_and_free(size);
        assert!(
            again < 100,
            "{again} page faults re-allocating a freed block"
        );
    }
}
