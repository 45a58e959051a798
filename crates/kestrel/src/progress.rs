//! Loading progress on stderr: a progress bar on a terminal, a plain line at each quarter
//! otherwise (logs and pipes stay readable).

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A callback for `Session::with_progress`: (bytes done, bytes in all).
pub fn loading(what: &str) -> impl FnMut(u64, u64) + 'static {
    let what = what.to_string();
    let mut bar: Option<ProgressBar> = None;
    let mut quarter = 0;
    let terminal = std::io::stderr().is_terminal();
    move |done, total| {
        if terminal {
            let b = bar.get_or_insert_with(|| {
                let b = ProgressBar::new(total);
                let style = ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})")
                    .expect("a valid template")
                    .progress_chars("=> ");
                b.set_style(style);
                b.set_message(format!("loading {what}"));
                b
            });
            b.set_position(done);
            if done >= total {
                b.finish_and_clear();
            }
        } else {
            let q = (done * 4).checked_div(total).unwrap_or(4) as usize;
            while quarter < q {
                quarter += 1;
                eprintln!(
                    "loading {what}: {}% ({:.1} of {:.1} MiB)",
                    quarter * 25,
                    done as f64 / (1 << 20) as f64,
                    total as f64 / (1 << 20) as f64
                );
            }
        }
    }
}
