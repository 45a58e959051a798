//! Counters of everything the runtime does, and the per-dispatch profile.
//!
//! The device owns one [`Counters`]; [`Counters::snapshot`] returns a plain [`CounterSnapshot`]
//! that callers can diff around a region of interest.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Debug, Default)]
pub struct Counters {
    dispatches: AtomicU64,
    submissions: AtomicU64,
    host_syncs: AtomicU64,
    graph_launches: AtomicU64,
    graph_nodes: AtomicU64,
    graph_edges: AtomicU64,
    graph_programmatic_edges: AtomicU64,
    graph_instantiations: AtomicU64,
    graph_updates: AtomicU64,
    bytes_h2d: AtomicU64,
    bytes_d2h: AtomicU64,
    bytes_d2d: AtomicU64,
    fence_signals: AtomicU64,
    fence_waits: AtomicU64,
    kernel_compiles: AtomicU64,
    kernel_cache_hits: AtomicU64,
}

/// A copy of the counters at one moment. `after - before` gives the work of a region.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Kernel launches, eager or as graph nodes when the graph is launched.
    pub dispatches: u64,
    /// Command lists run eagerly plus graph launches.
    pub submissions: u64,
    /// Times the host blocked on the device (stream, event or device synchronisation).
    pub host_syncs: u64,
    pub graph_launches: u64,
    /// Nodes and edges of the graphs instantiated so far.
    pub graph_nodes: u64,
    pub graph_edges: u64,
    /// Of those edges, the ones that let a kernel launch before its predecessor finished.
    pub graph_programmatic_edges: u64,
    pub graph_instantiations: u64,
    /// Graph-exec updates applied without re-instantiation.
    pub graph_updates: u64,
    pub bytes_h2d: u64,
    pub bytes_d2h: u64,
    pub bytes_d2d: u64,
    pub fence_signals: u64,
    pub fence_waits: u64,
    /// NVRTC compilations and modules loaded from the disk cache.
    pub kernel_compiles: u64,
    pub kernel_cache_hits: u64,
}

macro_rules! counter_fns {
    ($($field:ident => $add:ident),* $(,)?) => {
        impl Counters {
            $(pub(crate) fn $add(&self, n: u64) { self.$field.fetch_add(n, Relaxed); })*

            pub fn snapshot(&self) -> CounterSnapshot {
                CounterSnapshot { $($field: self.$field.load(Relaxed)),* }
            }

            pub fn reset(&self) {
                $(self.$field.store(0, Relaxed);)*
            }
        }

        impl std::ops::Sub for CounterSnapshot {
            type Output = CounterSnapshot;
            fn sub(self, before: CounterSnapshot) -> CounterSnapshot {
                CounterSnapshot { $($field: self.$field - before.$field),* }
            }
        }
    };
}

counter_fns!(
    dispatches => add_dispatches,
    submissions => add_submissions,
    host_syncs => add_host_syncs,
    graph_launches => add_graph_launches,
    graph_nodes => add_graph_nodes,
    graph_edges => add_graph_edges,
    graph_programmatic_edges => add_graph_programmatic_edges,
    graph_instantiations => add_graph_instantiations,
    graph_updates => add_graph_updates,
    bytes_h2d => add_bytes_h2d,
    bytes_d2h => add_bytes_d2h,
    bytes_d2d => add_bytes_d2d,
    fence_signals => add_fence_signals,
    fence_waits => add_fence_waits,
    kernel_compiles => add_kernel_compiles,
    kernel_cache_hits => add_kernel_cache_hits,
);

/// Timing statistics of one label or kernel, in microseconds of GPU time.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct TimingStat {
    pub count: u64,
    pub total_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

impl TimingStat {
    fn add(&mut self, us: f64) {
        if self.count == 0 || us < self.min_us {
            self.min_us = us;
        }
        if us > self.max_us {
            self.max_us = us;
        }
        self.count += 1;
        self.total_us += us;
    }

    pub fn mean_us(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.total_us / self.count as f64
        }
    }
}

/// Per-dispatch GPU times aggregated by dispatch label and by kernel.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Profile {
    pub by_label: BTreeMap<String, TimingStat>,
    pub by_kernel: BTreeMap<String, TimingStat>,
}

impl Profile {
    pub(crate) fn record(&mut self, label: &str, kernel: &str, us: f64) {
        self.by_label.entry(label.to_string()).or_default().add(us);
        self.by_kernel.entry(kernel.to_string()).or_default().add(us);
    }

    /// A fixed-width table, slowest kernels first.
    pub fn table(&self) -> String {
        let mut rows: Vec<_> = self.by_kernel.iter().collect();
        rows.sort_by(|a, b| b.1.total_us.total_cmp(&a.1.total_us));
        let mut out = format!(
            "{:<32} {:>8} {:>12} {:>10} {:>10}\n",
            "kernel", "count", "total us", "mean us", "max us"
        );
        for (name, s) in rows {
            out += &format!(
                "{:<32} {:>8} {:>12.1} {:>10.2} {:>10.2}\n",
                name,
                s.count,
                s.total_us,
                s.mean_us(),
                s.max_us
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_diff_and_reset() {
        let c = Counters::default();
        c.add_dispatches(3);
        let before = c.snapshot();
        c.add_dispatches(2);
        c.add_bytes_h2d(100);
        let d = c.snapshot() - before;
        assert_eq!(d.dispatches, 2);
        assert_eq!(d.bytes_h2d, 100);
        c.reset();
        assert_eq!(c.snapshot(), CounterSnapshot::default());
    }

    #[test]
    fn profile_aggregates_by_label_and_kernel() {
        let mut p = Profile::default();
        p.record("layer0.norm", "rms_norm_f32", 2.0);
        p.record("layer1.norm", "rms_norm_f32", 4.0);
        p.record("layer0.attn", "attn_f32", 10.0);
        let k = &p.by_kernel["rms_norm_f32"];
        assert_eq!((k.count, k.min_us, k.max_us), (2, 2.0, 4.0));
        assert_eq!(k.mean_us(), 3.0);
        assert_eq!(p.by_label.len(), 3);
        let t = p.table();
        assert!(
            t.find("attn_f32").unwrap() < t.find("rms_norm_f32").unwrap(),
            "{t}"
        );
    }
}
