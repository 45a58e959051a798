//! What a session's streamed experts cost, summed over its layers' caches, and routing traces
//! replayed through the same books (`kestrel_core::expert_slots`) to compare eviction
//! policies. Each MoE layer has a cache of its own slots, so a layer's experts never evict
//! another layer's; the books of the layers the graph serves live on the backend, those of the
//! layers the host serves on the host, and both follow `expert_slots::resolve`.

use kestrel_core::expert_slots::{self, resolve, table_words, TableStats};

/// Which cached expert leaves when a missing one needs its slot.
pub use kestrel_core::expert_slots::SlotPolicy as Eviction;

/// What the caches did, over every layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Distinct experts decode steps asked for, layer by layer.
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    /// Misses that pushed another expert out (the others took a free slot).
    pub evictions: u64,
    /// Experts longer chunks copied from host memory or the checkpoint to their staging area.
    pub staged: u64,
    /// Bytes copied in: misses and staged experts.
    pub bytes_copied: u64,
}

impl CacheStats {
    /// Hits over lookups (1 when nothing was asked).
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            1.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }

    /// Adds one layer's books, of `slots` slots of `span` bytes.
    pub fn add_layer(&mut self, t: TableStats, slots: usize, span: u64) {
        self.lookups += t.lookups;
        self.hits += t.lookups - t.misses;
        self.misses += t.misses;
        // Slots start free and never free up again, so every miss after the first `slots`
        // evicted an expert.
        self.evictions += t.misses.saturating_sub(slots as u64);
        self.staged += t.staged;
        self.bytes_copied += (t.misses + t.staged) * span;
    }
}

/// Replays a routing trace (one decode step of one layer per (layer, experts) entry) through
/// caches of `slots` slots per layer and returns what they did.
pub fn simulate(
    trace: &[(usize, Vec<u32>)],
    experts: usize,
    slots: usize,
    span_bytes: u64,
    policy: Eviction,
) -> Result<CacheStats, String> {
    let layers = trace.iter().map(|(l, _)| l + 1).max().unwrap_or(0);
    let mut tables = vec![vec![0u32; table_words(slots, experts)]; layers];
    for (layer, ids) in trace {
        let mut out = vec![0; ids.len()];
        resolve(&mut tables[*layer], slots, experts, policy, ids, &mut out)?;
    }
    let mut stats = CacheStats::default();
    for t in &tables {
        stats.add_layer(expert_slots::stats(t), slots, span_bytes);
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frequency_keeps_a_popular_expert_that_lru_would_drop() {
        // Expert 1 is used often, then two others pass through once each.
        let trace: Vec<(usize, Vec<u32>)> = [1, 1, 1, 1, 2, 3, 1].iter().map(|&e| (0, vec![e])).collect();
        let lru = simulate(&trace, 8, 2, 1, Eviction::Lru).unwrap();
        let freq = simulate(&trace, 8, 2, 1, Eviction::Frequency { half_life: 100 }).unwrap();
        assert_eq!(lru.misses, 4, "{lru:?}");
        assert_eq!(freq.misses, 3, "{freq:?}");
        assert_eq!(
            (lru.lookups, lru.hits, lru.evictions, lru.bytes_copied),
            (7, 3, 2, 4)
        );
    }

    #[test]
    fn layers_have_caches_of_their_own() {
        // The same expert number in another layer is another expert, in another cache.
        let trace = vec![(0, vec![3]), (1, vec![3]), (0, vec![3]), (1, vec![3])];
        let s = simulate(&trace, 8, 1, 10, Eviction::Lru).unwrap();
        assert_eq!((s.misses, s.hits, s.evictions), (2, 2, 0));
    }

    #[test]
    fn old_popularity_fades() {
        // Expert 1 was used 8 times, then expert 2 five times; expert 3 needs a slot. With a
        // long half-life 1 still weighs 8 against 2's 5 and 2 leaves (1 hits afterwards); with a
        // half-life of two steps 1's uses have faded below 2's and 1 leaves (2 hits).
        let mut trace: Vec<(usize, Vec<u32>)> = (0..8).map(|_| (0, vec![1])).collect();
        trace.extend((0..5).map(|_| (0, vec![2])));
        trace.push((0, vec![3]));
        let kept = |half_life: u32, e: u32| {
            let mut t = trace.clone();
            t.push((0, vec![e]));
            simulate(&t, 8, 2, 1, Eviction::Frequency { half_life })
                .unwrap()
                .misses
        };
        assert_eq!(kept(1_000_000, 1), 3);
        assert_eq!(kept(1_000_000, 2), 4);
        assert_eq!(kept(2, 2), 3);
        assert_eq!(kept(2, 1), 4);
    }
}
