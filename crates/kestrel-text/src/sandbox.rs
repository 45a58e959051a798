//! The sandbox a chat template renders in: a short-lived thread with a memory budget and a
//! deadline, and [`BoundedAlloc`], the global allocator that holds that thread to its budget.
//!
//! `run` starts the work on a thread of its own and waits for it until the deadline. While the
//! work runs, every allocation the thread makes is counted against its budget (the bytes it
//! allocated minus the bytes it freed, since it started). An allocation that would pass the
//! budget, or any allocation after the caller's deadline passed, is not made: an allocator may
//! neither return null (Rust aborts the process on that) nor unwind, so the allocator records the
//! overrun, wakes the caller, and parks the thread for good. The caller returns an error; the
//! parked thread is leaked, holding at most the budget, and whatever locks it held stay held, so
//! the caller must not touch what the work shared again (the chat template marks itself unusable).
//! A panicking thread is not held to the budget (a parked panic hook would keep the standard error
//! lock from every other thread); a panic is caught and returned as an error.
//!
//! The budget holds only where [`BoundedAlloc`] is the global allocator, which the binary installs:
//!
//! ```no_run
//! #[global_allocator]
//! static ALLOC: kestrel_text::BoundedAlloc = kestrel_text::BoundedAlloc::new();
//! # fn main() {}
//! ```
//!
//! Without it the work still runs on its own thread, so the caller still gets its answer by the
//! deadline, but nothing bounds the thread's memory, and a thread past its deadline runs on until
//! it finishes by itself (for a template, until its fuel is spent). [`BoundedAlloc::is_installed`]
//! says which case holds.
//!
//! Architecture invariant: nothing the allocator runs allocates. It reads a `const`-initialised
//! thread-local pointer without a destructor, which on targets with native thread-locals (Linux,
//! Windows, macOS) is a plain memory read (threads that are not in `run` pay that one read and
//! nothing more); on a metered thread it touches only atomics, `Thread::unpark` and
//! `thread::sleep`. A thread past its deadline is stopped at its next allocation; one that computes
//! without allocating cannot be stopped from outside and runs on until it ends by itself (for a
//! template, at the latest when its fuel is spent).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// The global allocator that holds sandboxed work to its memory budget: [`System`] with a count
/// of the bytes each sandboxed thread holds. Threads outside the sandbox allocate as with
/// [`System`], after one thread-local read.
#[derive(Debug, Default)]
pub struct BoundedAlloc {
    _private: (),
}

impl BoundedAlloc {
    pub const fn new() -> BoundedAlloc {
        BoundedAlloc { _private: () }
    }

    /// Whether this allocator is the process's global allocator (checked with one small
    /// allocation the first time).
    pub fn is_installed() -> bool {
        if !INSTALLED.load(Ordering::Relaxed) {
            let previous = METER.replace(PROBE);
            // `black_box` keeps the compiler from removing the allocation.
            drop(std::hint::black_box(Box::new(0u8)));
            METER.set(previous);
        }
        INSTALLED.load(Ordering::Relaxed)
    }
}

/// Set once an allocation reached [`BoundedAlloc`] while [`BoundedAlloc::is_installed`] probed.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The `METER` value while [`BoundedAlloc::is_installed`] probes; never dereferenced (no `Meter`
/// lives at a dangling address).
const PROBE: *const Meter = ptr::NonNull::dangling().as_ptr();

thread_local! {
    /// The meter of the sandboxed work running on this thread; null on every other thread.
    /// `const`-initialised and without a destructor, so reading it never allocates, even while
    /// the thread starts or ends.
    static METER: Cell<*const Meter> = const { Cell::new(ptr::null()) };
}

/// `Meter::state` values. The work is running.
const RUNNING: u8 = 0;
/// The work ended and left its result.
const DONE: u8 = 1;
/// The work asked for more memory than its budget; its thread is parked.
const OVER_BUDGET: u8 = 2;
/// The caller's deadline passed; the thread parks at its next allocation.
const CANCELLED: u8 = 3;

/// What one sandboxed thread may hold, what it holds, and how it ended.
struct Meter {
    /// Bytes the thread may hold.
    budget: isize,
    /// Bytes the thread allocated minus bytes it freed. Only that thread writes it.
    used: AtomicIsize,
    /// The size of the allocation that was refused.
    refused: AtomicUsize,
    /// `RUNNING`, then one of `DONE`, `OVER_BUDGET` or `CANCELLED`.
    state: AtomicU8,
    /// The thread waiting in [`run`], woken when `state` leaves `RUNNING`.
    caller: Thread,
}

impl Meter {
    /// Counts `delta` bytes more (or fewer) held; stops the thread for good when a growth passes
    /// the budget or comes after the deadline. Allocates nothing.
    fn charge(&self, delta: isize) {
        let used = self.used.load(Ordering::Relaxed).saturating_add(delta);
        // A panicking thread is let through: its panic hook may hold the standard error lock,
        // which a parked thread would keep from every other thread.
        if delta > 0
            && (used > self.budget || self.state.load(Ordering::Acquire) == CANCELLED)
            && !thread::panicking()
        {
            self.stop(delta as usize);
        }
        self.used.store(used, Ordering::Relaxed);
    }

    /// Records the refused allocation, wakes the caller and parks this thread for good.
    fn stop(&self, refused: usize) -> ! {
        self.refused.store(refused, Ordering::Relaxed);
        if self
            .state
            .compare_exchange(RUNNING, OVER_BUDGET, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.caller.unpark();
        }
        loop {
            thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// Counts an allocation's growth (or shrinkage) against the current thread's meter, if it has one.
#[inline]
fn charge(delta: isize) {
    let meter = METER.get();
    if !meter.is_null() {
        charge_metered(meter, delta);
    }
}

#[cold]
#[inline(never)]
fn charge_metered(meter: *const Meter, delta: isize) {
    if meter == PROBE {
        INSTALLED.store(true, Ordering::Relaxed);
        return;
    }
    // SAFETY: `METER` is non-null and not `PROBE` only inside `run`'s thread body, between
    // setting it to the `Meter` of an `Arc` that body owns and resetting it to null before that
    // `Arc` is dropped; the pointee is therefore alive, and only shared references to it exist.
    let meter = unsafe { &*meter };
    meter.charge(delta);
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so `System`'s
// guarantees carry over; the metering before it neither allocates (see the module's invariant)
// nor unwinds (it touches only atomics and, when it stops a thread, never returns).
unsafe impl GlobalAlloc for BoundedAlloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // A `Layout`'s size is at most `isize::MAX`.
        charge(layout.size() as isize);
        // SAFETY: the caller's contract for `alloc` is `System.alloc`'s.
        unsafe { System.alloc(layout) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size() as isize);
        // SAFETY: the caller's contract for `alloc_zeroed` is `System.alloc_zeroed`'s.
        unsafe { System.alloc_zeroed(layout) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        charge(-(layout.size() as isize));
        // SAFETY: `ptr` came from this allocator, that is from `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Both sizes are at most `isize::MAX`, so the difference fits.
        charge(new_size as isize - layout.size() as isize);
        // SAFETY: `ptr` came from `System` with `layout`; the caller's contract for `realloc` is
        // `System.realloc`'s.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Why sandboxed work did not end by itself.
#[derive(Debug)]
pub(crate) enum Stopped {
    /// Its thread asked for `refused` bytes more while holding `used`, past `budget`.
    Memory {
        budget: usize,
        used: isize,
        refused: usize,
    },
    /// It was still running at the deadline, `limit` after it started.
    Time { limit: Duration },
    /// It panicked; the message is the panic's.
    Panic(String),
    /// Its thread could not be started.
    Spawn(std::io::Error),
}

/// Runs `work` on a thread of its own that may hold at most `budget` bytes (where
/// [`BoundedAlloc`] is installed), and waits at most `limit` for it. On `Stopped::Memory` and
/// `Stopped::Time` the thread may be parked for good, holding whatever `work` had locked.
pub(crate) fn run<T, F>(budget: usize, limit: Duration, work: F) -> Result<T, Stopped>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let meter = Arc::new(Meter {
        budget: isize::try_from(budget).unwrap_or(isize::MAX),
        used: AtomicIsize::new(0),
        refused: AtomicUsize::new(0),
        state: AtomicU8::new(RUNNING),
        caller: thread::current(),
    });
    let slot: Arc<Mutex<Option<thread::Result<T>>>> = Arc::new(Mutex::new(None));
    let (thread_meter, thread_slot) = (Arc::clone(&meter), Arc::clone(&slot));
    let start = Instant::now();
    thread::Builder::new()
        .name("kestrel-sandbox".into())
        .stack_size(stack_for(budget))
        .spawn(move || {
            METER.set(Arc::as_ptr(&thread_meter));
            let result = panic::catch_unwind(AssertUnwindSafe(work));
            METER.set(ptr::null());
            // Unmetered from here: nothing below can be stopped half-way.
            *thread_slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(result);
            if thread_meter
                .state
                .compare_exchange(RUNNING, DONE, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                thread_meter.caller.unpark();
            }
        })
        .map_err(Stopped::Spawn)?;
    let deadline = start + limit;
    loop {
        match meter.state.load(Ordering::Acquire) {
            DONE => {
                let result = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
                return match result {
                    Some(Ok(value)) => Ok(value),
                    Some(Err(payload)) => Err(Stopped::Panic(panic_message(payload.as_ref()))),
                    None => Err(Stopped::Panic("the sandboxed work ended without a result".into())),
                };
            }
            OVER_BUDGET => {
                return Err(Stopped::Memory {
                    budget,
                    used: meter.used.load(Ordering::Relaxed),
                    refused: meter.refused.load(Ordering::Relaxed),
                })
            }
            _ => {
                let now = Instant::now();
                if now >= deadline {
                    // A thread that finished or overran just now wins; the loop reads its state.
                    if meter
                        .state
                        .compare_exchange(RUNNING, CANCELLED, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        return Err(Stopped::Time { limit });
                    }
                } else {
                    thread::park_timeout(deadline - now);
                }
            }
        }
    }
}

/// The least stack a sandboxed thread gets: what a main thread usually has.
const MIN_STACK: usize = 8 << 20;
/// The most: beyond it a larger budget buys no more stack.
const MAX_STACK: usize = 2 << 30;
/// Stack bytes a sandboxed thread gets for each byte of its memory budget.
const STACK_PER_BUDGET_BYTE: usize = 32;

/// The stack for a thread that may hold `budget` bytes (address space: only the pages the work
/// reaches are used). A value nested deeper than a stack holds aborts the process when
/// minijinja recurses over it: dropping it, or printing it (`'' ~ value`), a frame a level. A
/// list nested in a list takes at least 85 bytes of heap a level, so the budget bounds the
/// depth; printing, the deepest of these recursions, took 1 to 2 GiB of stack for 3 million
/// levels (up to about 700 bytes a level, more in a debug build). Hence 32 bytes of stack for a
/// byte of budget: 2 GiB for the default 64 MiB, room for every value the budget lets a template
/// build. Budgets above 64 MiB get no more stack, so their deepest values are not covered.
fn stack_for(budget: usize) -> usize {
    budget
        .saturating_mul(STACK_PER_BUDGET_BYTE)
        .clamp(MIN_STACK, MAX_STACK)
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}
