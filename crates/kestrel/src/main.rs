//! The `kestrel` binary: the command line of [`kestrel`], the library beside it, with the
//! chat-template sandbox's allocator installed.

/// Every allocation goes through the chat-template sandbox's allocator, which holds a template
/// render's thread to its memory budget (other threads pay one thread-local read).
#[global_allocator]
static ALLOC: kestrel_text::BoundedAlloc = kestrel_text::BoundedAlloc::new();

fn main() -> std::process::ExitCode {
    kestrel::main()
}
