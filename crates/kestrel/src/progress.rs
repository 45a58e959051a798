//! Loading and long prefills on stderr: progress as a bar on a terminal, a plain line at each quarter otherwise
//! (logs and pipes stay readable), and where the model's bytes went when it streams.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use kestrel_engine::ByteSize;

/// A callback for `Session::with_progress`: (bytes done, bytes in all).
pub fn loading(what: &str) -> impl FnMut(u64, u64) + 'static {
    meter(format!("loading {what}"), Unit::Bytes)
}

/// A callback for a long prefill run in chunks: (tokens done, tokens in all).
pub fn prefill() -> impl FnMut(usize, usize) + 'static {
    let mut m = meter("prefill".to_string(), Unit::Tokens);
    move |done, total| m(done as u64, total as u64)
}

#[derive(Clone, Copy)]
enum Unit {
    Bytes,
    Tokens,
}

/// Progress of `what`: a bar on a terminal, otherwise a plain line each time a new quarter is
/// reached.
fn meter(what: String, unit: Unit) -> impl FnMut(u64, u64) + 'static {
    let mut bar: Option<ProgressBar> = None;
    let mut quarter = 0;
    let terminal = std::io::stderr().is_terminal();
    move |done, total| {
        if terminal {
            let b = bar.get_or_insert_with(|| {
                let b = ProgressBar::new(total);
                let counts = match unit {
                    Unit::Bytes => "{bytes}/{total_bytes}",
                    Unit::Tokens => "{pos}/{len} tokens",
                };
                let style = ProgressStyle::with_template(&format!("{{msg}} [{{bar:40}}] {counts} ({{eta}})"))
                    .expect("a valid template")
                    .progress_chars("=> ");
                b.set_style(style);
                b.set_message(what.clone());
                b
            });
            b.set_position(done);
            if done >= total {
                b.finish_and_clear();
            }
        } else {
            // A line when a new quarter is reached, with the figures as they are.
            let q = (done * 4).checked_div(total).unwrap_or(4) as usize;
            if q > quarter {
                quarter = q;
                let pct = (done * 100).checked_div(total).unwrap_or(100);
                match unit {
                    Unit::Bytes => errln!(
                        "{what}: {pct}% ({:.1} of {:.1} MiB)",
                        done as f64 / (1 << 20) as f64,
                        total as f64 / (1 << 20) as f64
                    ),
                    Unit::Tokens => errln!("{what}: {pct}% ({done} of {total} tokens)"),
                }
            }
        }
    }
}

/// Says on stderr that `engine`'s experts stream, and where its bytes went.
pub fn placement(engine: &kestrel_engine::Engine) {
    let Some(p) = engine.placement() else { return };
    let total = p.moe_layers * p.experts_per_layer;
    errln!(
        "streaming experts: the model does not fit, so {} of its {total} routed experts ({:.0}%, \
         {} of each layer's {}) are cached on the {} beside {} of resident weights, caches and \
         activations; the others come from host memory ({} experts) or the checkpoint on disk \
         ({}) (--gpu-mem, --host-mem)",
        p.gpu_experts,
        100.0 * p.gpu_experts as f64 / total as f64,
        p.slots_per_layer,
        p.experts_per_layer,
        engine.backend(),
        ByteSize(p.resident_bytes),
        p.host_experts,
        p.disk_experts
    );
}

/// Warns on stderr when streamed experts come from slower memory than planned.
pub fn host_tier_warning(engine: &kestrel_engine::Engine) {
    if let Some(note) = engine.host_tier_note() {
        errln!("warning: {note}");
    }
}
