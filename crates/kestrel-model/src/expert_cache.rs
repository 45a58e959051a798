//! The bookkeeping of a cache of routed experts: which (layer, expert) each slot holds, which
//! slot a routed expert takes, which expert leaves when the cache is full, and what it all cost.
//! A slot holds one expert's span (the engine stores an expert as one contiguous span), so a
//! miss is one copy of `span_bytes`. The code knows no backend: the same cache drives the CPU
//! backend's small-budget runs (which CI uses to exercise evictions) and the GPU cache.
//!
//! One `resolve` is one layer's step: every expert it names gets a slot at once, so none of
//! them may evict another (they are pinned for the call); the others are chosen by the
//! eviction policy.

use std::collections::HashMap;

/// Which cached expert leaves when a missed one needs its slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Eviction {
    /// The least recently used.
    Lru,
    /// The least often used, counting uses with a weight that halves every `half_life` steps
    /// (so old popularity fades); ties go to the least recently used.
    FrequencyLru { half_life: f64 },
}

/// What the cache did since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Distinct experts asked for, step by step.
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    /// Misses that pushed another expert out (the others took a free slot).
    pub evictions: u64,
    /// Bytes the misses copied in.
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
}

/// A missed expert and the slot it goes to, which the caller fills before the step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Miss {
    pub expert: u32,
    pub slot: u32,
    /// The (layer, expert) the slot held before, if any.
    pub evicted: Option<(usize, u32)>,
}

/// The slots of one step's experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The slot of each expert asked for, in the order asked (repeats share a slot).
    pub slots: Vec<u32>,
    /// The experts to copy in, each once.
    pub misses: Vec<Miss>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    #[error("a step needs {needed} experts at once but the cache has {slots} slots")]
    TooFewSlots { needed: usize, slots: usize },
}

/// A use count that fades: `count` at step `at`, and the same as a score that compares alike
/// at every later step: `log2(count) + at / half_life` (the fading `- now / half_life` is
/// common to all), so finding a victim needs no exponentials.
#[derive(Debug, Clone, Copy)]
struct Uses {
    count: f64,
    at: u64,
    score: f64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    holds: Option<(usize, u32)>,
    /// Its expert's `Uses::score` (frequency-weighted LRU).
    score: f64,
    last_use: u64,
    /// The step that pinned it last (it may not be evicted in that step).
    pinned_at: u64,
}

/// The cache's state: slots, where each cached expert is, use counts.
#[derive(Debug, Clone)]
pub struct ExpertCache {
    slots: Vec<Slot>,
    map: HashMap<(usize, u32), u32>,
    uses: HashMap<(usize, u32), Uses>,
    policy: Eviction,
    span_bytes: u64,
    step: u64,
    stats: CacheStats,
}

impl ExpertCache {
    /// An empty cache of `slots` slots of `span_bytes` each.
    pub fn new(slots: usize, span_bytes: u64, policy: Eviction) -> ExpertCache {
        ExpertCache {
            slots: vec![Slot::default(); slots],
            map: HashMap::new(),
            uses: HashMap::new(),
            policy,
            span_bytes,
            step: 0,
            stats: CacheStats::default(),
        }
    }

    /// Sets the bytes a miss copies (when the span is known only once the graph is built).
    pub fn set_span_bytes(&mut self, span_bytes: u64) {
        self.span_bytes = span_bytes;
    }

    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// The slot holding `expert` of `layer`, if it is cached.
    pub fn slot_of(&self, layer: usize, expert: u32) -> Option<u32> {
        self.map.get(&(layer, expert)).copied()
    }

    /// The weight of `key`'s uses as of the current step.
    fn weight(&self, key: (usize, u32)) -> f64 {
        match (self.uses.get(&key), self.policy) {
            (Some(u), Eviction::FrequencyLru { half_life }) => {
                u.count * 0.5f64.powf((self.step - u.at) as f64 / half_life.max(f64::MIN_POSITIVE))
            }
            (Some(u), Eviction::Lru) => u.count,
            (None, _) => 0.0,
        }
    }

    /// The slot a miss takes: a free one, else the policy's victim among those not pinned in
    /// this step (there is one: the step's experts fit, checked by `resolve`).
    fn victim(&self) -> usize {
        if let Some(free) = self.slots.iter().position(|s| s.holds.is_none()) {
            return free;
        }
        let candidates = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.pinned_at != self.step);
        let chosen = match self.policy {
            Eviction::Lru => candidates.min_by_key(|(_, s)| s.last_use),
            Eviction::FrequencyLru { .. } => candidates
                .min_by(|(_, a), (_, b)| a.score.total_cmp(&b.score).then(a.last_use.cmp(&b.last_use))),
        };
        chosen
            .map(|(i, _)| i)
            .expect("a step's experts fit, so an unpinned slot exists")
    }

    /// Gives every expert of one step of `layer` a slot: hits keep theirs, misses take a free
    /// slot or evict. The returned misses must be copied in before the step runs.
    pub fn resolve(&mut self, layer: usize, experts: &[u32]) -> Result<Resolved, CacheError> {
        let mut distinct: Vec<u32> = Vec::with_capacity(experts.len());
        for &e in experts {
            if !distinct.contains(&e) {
                distinct.push(e);
            }
        }
        if distinct.len() > self.slots.len() {
            return Err(CacheError::TooFewSlots {
                needed: distinct.len(),
                slots: self.slots.len(),
            });
        }
        self.step += 1;
        let step = self.step;
        // Count the uses and pin the hits first, so no miss of this step evicts them.
        let mut missed = Vec::new();
        for &e in &distinct {
            let key = (layer, e);
            let count = self.weight(key) + 1.0;
            let score = match self.policy {
                Eviction::FrequencyLru { half_life } => {
                    count.log2() + step as f64 / half_life.max(f64::MIN_POSITIVE)
                }
                Eviction::Lru => 0.0,
            };
            self.uses.insert(
                key,
                Uses {
                    count,
                    at: step,
                    score,
                },
            );
            self.stats.lookups += 1;
            match self.map.get(&key) {
                Some(&slot) => {
                    self.stats.hits += 1;
                    let s = &mut self.slots[slot as usize];
                    s.last_use = step;
                    s.pinned_at = step;
                    s.score = score;
                }
                None => missed.push(e),
            }
        }
        let mut misses = Vec::with_capacity(missed.len());
        for e in missed {
            let i = self.victim();
            let evicted = self.slots[i].holds.take();
            if let Some(old) = evicted {
                self.map.remove(&old);
                self.stats.evictions += 1;
            }
            self.slots[i] = Slot {
                holds: Some((layer, e)),
                score: self.uses[&(layer, e)].score,
                last_use: step,
                pinned_at: step,
            };
            self.map.insert((layer, e), i as u32);
            self.stats.misses += 1;
            self.stats.bytes_copied += self.span_bytes;
            misses.push(Miss {
                expert: e,
                slot: i as u32,
                evicted,
            });
        }
        let slots = experts.iter().map(|&e| self.map[&(layer, e)]).collect();
        Ok(Resolved { slots, misses })
    }
}

/// Replays a routing trace (one step per (layer, experts) entry) through a cache of `slots`
/// slots and returns what it cost: how eviction policies compare on the same routing.
pub fn simulate(
    trace: &[(usize, Vec<u32>)],
    slots: usize,
    span_bytes: u64,
    policy: Eviction,
) -> Result<CacheStats, CacheError> {
    let mut cache = ExpertCache::new(slots, span_bytes, policy);
    for (layer, experts) in trace {
        cache.resolve(*layer, experts)?;
    }
    Ok(cache.stats())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_core::rng::Rng;

    /// Every slot holds what the map says, and no expert is in two slots.
    fn consistent(c: &ExpertCache) {
        for (&key, &slot) in &c.map {
            assert_eq!(c.slots[slot as usize].holds, Some(key));
        }
        let held = c.slots.iter().filter(|s| s.holds.is_some()).count();
        assert_eq!(held, c.map.len());
    }

    #[test]
    fn hits_keep_their_slot_and_misses_fill_free_ones_first() {
        let mut c = ExpertCache::new(4, 100, Eviction::Lru);
        let r = c.resolve(0, &[3, 1]).unwrap();
        assert_eq!(r.misses.len(), 2);
        assert!(r.misses.iter().all(|m| m.evicted.is_none()));
        let again = c.resolve(0, &[1, 3, 1]).unwrap();
        assert!(again.misses.is_empty());
        assert_eq!(again.slots, vec![r.slots[1], r.slots[0], r.slots[1]]);
        // The same expert number of another layer is another expert.
        assert_eq!(c.resolve(1, &[3]).unwrap().misses.len(), 1);
        let s = c.stats();
        assert_eq!((s.lookups, s.hits, s.misses, s.evictions), (5, 2, 3, 0));
        assert_eq!(s.bytes_copied, 300);
        consistent(&c);
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let mut c = ExpertCache::new(2, 1, Eviction::Lru);
        c.resolve(0, &[1]).unwrap();
        c.resolve(0, &[2]).unwrap();
        c.resolve(0, &[1]).unwrap();
        let r = c.resolve(0, &[3]).unwrap();
        assert_eq!(r.misses[0].evicted, Some((0, 2)));
        assert!(c.slot_of(0, 1).is_some() && c.slot_of(0, 2).is_none());
        consistent(&c);
    }

    #[test]
    fn frequency_keeps_a_popular_expert_that_lru_would_drop() {
        // Expert 1 is used often, then two others pass through once each.
        let trace: Vec<(usize, Vec<u32>)> = [1, 1, 1, 1, 2, 3, 1].iter().map(|&e| (0, vec![e])).collect();
        let lru = simulate(&trace, 2, 1, Eviction::Lru).unwrap();
        let freq = simulate(&trace, 2, 1, Eviction::FrequencyLru { half_life: 100.0 }).unwrap();
        assert_eq!(lru.misses, 4, "{lru:?}");
        assert_eq!(freq.misses, 3, "{freq:?}");
    }

    #[test]
    fn old_popularity_fades() {
        // Expert 1 was used 8 times, then expert 2 five times; expert 3 needs a slot. With a
        // long half-life 1 still weighs 8 against 2's 5 and 2 leaves; with a half-life of two
        // steps 1's uses have faded below 2's and 1 leaves.
        let mut trace: Vec<(usize, Vec<u32>)> = (0..8).map(|_| (0, vec![1])).collect();
        trace.extend((0..5).map(|_| (0, vec![2])));
        let evicted = |half_life| {
            let mut c = ExpertCache::new(2, 1, Eviction::FrequencyLru { half_life });
            for (l, e) in &trace {
                c.resolve(*l, e).unwrap();
            }
            c.resolve(0, &[3]).unwrap().misses[0].evicted
        };
        assert_eq!(evicted(1e9), Some((0, 2)));
        assert_eq!(evicted(2.0), Some((0, 1)));
    }

    #[test]
    fn a_steps_experts_never_evict_each_other() {
        for policy in [Eviction::Lru, Eviction::FrequencyLru { half_life: 4.0 }] {
            let mut c = ExpertCache::new(3, 1, policy);
            c.resolve(0, &[0, 1, 2]).unwrap();
            let r = c.resolve(0, &[5, 0, 6]).unwrap();
            assert_eq!(r.misses.len(), 2);
            assert!(
                c.slot_of(0, 0).is_some(),
                "{policy:?}: the hit was evicted by its own step"
            );
            let mut s = r.slots.clone();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), 3);
            consistent(&c);
        }
    }

    #[test]
    fn a_step_larger_than_the_cache_is_an_error() {
        let mut c = ExpertCache::new(2, 1, Eviction::Lru);
        assert_eq!(
            c.resolve(0, &[1, 2, 3, 1]),
            Err(CacheError::TooFewSlots { needed: 3, slots: 2 })
        );
        assert_eq!(c.stats(), CacheStats::default());
    }

    #[test]
    fn random_routing_keeps_the_cache_consistent() {
        let mut rng = Rng::new(7);
        for policy in [Eviction::Lru, Eviction::FrequencyLru { half_life: 16.0 }] {
            let mut c = ExpertCache::new(13, 10, policy);
            for step in 0..2000 {
                let layer = step % 5;
                let k = 1 + rng.range(0, 8);
                let experts: Vec<u32> = (0..k).map(|_| rng.range(0, 40) as u32).collect();
                let r = c.resolve(layer, &experts).unwrap();
                for (e, s) in experts.iter().zip(&r.slots) {
                    assert_eq!(c.slots[*s as usize].holds, Some((layer, *e)));
                }
                consistent(&c);
            }
            let s = c.stats();
            assert_eq!(s.hits + s.misses, s.lookups);
            assert_eq!(s.bytes_copied, 10 * s.misses);
            assert!(s.misses >= 13 && s.evictions == s.misses - 13, "{s:?}");
        }
    }
}
