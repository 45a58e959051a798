//! Stop strings in streamed text: text that may still turn into a stop string is held back, and
//! a completed stop string ends the stream without being printed.

pub struct StopStrings {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

/// What one push of text gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text that can be printed.
    pub text: String,
    /// A stop string was completed: generation ends.
    pub stopped: bool,
}

impl StopStrings {
    /// Empty stop strings are ignored.
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> StopStrings {
        StopStrings {
            stops: stops
                .into_iter()
                .map(Into::into)
                .filter(|s: &String| !s.is_empty())
                .collect(),
            held: String::new(),
            stopped: false,
        }
    }

    pub fn push(&mut self, text: &str) -> Released {
        if self.stopped {
            return Released {
                text: String::new(),
                stopped: true,
            };
        }
        self.held.push_str(text);
        // The earliest complete stop string ends everything.
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.stopped = true;
            let text = self.held[..at].to_string();
            self.held.clear();
            return Released { text, stopped: true };
        }
        // Hold back the longest tail that some stop string begins with.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let text = self.held[..keep].to_string();
        self.held.drain(..keep);
        Released { text, stopped: false }
    }

    /// The text still held back, at the end of generation (no stop string completed it).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The printed text and whether it stopped, feeding `pieces` one at a time.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().copied());
        let mut out = String::new();
        for p in pieces {
            let r = s.push(p);
            out += &r.text;
            if r.stopped {
                return (out, true);
            }
        }
        out += &s.finish();
        (out, false)
    }

    #[test]
    fn stop_strings_across_pieces() {
        assert_eq!(run(&["END"], &["abc E", "N", "D tail"]), ("abc ".into(), true));
        assert_eq!(run(&["END"], &["abc EN", "X"]), ("abc ENX".into(), false));
        assert_eq!(run(&["\n\n"], &["line\n", "\nnext"]), ("line".into(), true));
        // The earliest of two stops wins, and text before it is printed.
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), true));
        // A held tail that never completes is released at the end.
        assert_eq!(
            run(&["<|im_end|>"], &["hello <|im_"]),
            ("hello <|im_".into(), false)
        );
        // Multi-byte characters are never split.
        assert_eq!(run(&["é!"], &["café", "?"]), ("café?".into(), false));
        assert_eq!(run(&[], &["x"]), ("x".into(), false));
    }

    #[test]
    fn nothing_is_held_that_cannot_become_a_stop() {
        let mut s = StopStrings::new(["STOP"]);
        assert_eq!(s.push("abcS").text, "abc");
        assert_eq!(s.push("x").text, "Sx");
    }
}
