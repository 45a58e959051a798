//! The books of one MoE layer's cache of expert slots, and the one algorithm every backend
//! follows with them: which slot each routed expert takes, which cached expert leaves when a
//! missing one needs a slot, and what that cost. The books are a `u32` table that lives on the
//! backend beside the slots (a state of the graph), read and updated by the `ExpertFetch` and
//! `ExpertStage` ops inside the forward pass, so a streamed decode step needs no host work.
//! The CPU backend runs these functions; the CUDA kernels (`kernels/slots.cuh`, `stream.cu`) follow them step
//! for step, so both caches hold the same experts after the same steps.
//!
//! Table layout (u32 words), for `slots` slots and `experts` experts: the books,
//! `[clock, lookups lo/hi, misses lo/hi, staged lo/hi, 0, owner[slots], stamp[slots],
//! use_count[experts], use_at[experts]]`, then a second copy of them: a GPU fetch reads the
//! books in every block and writes the next ones into the copy, which a later kernel commits
//! (so no block reads books another is writing); after each step both copies are equal. `owner` is the held expert plus one (0:
//! free), `stamp` the clock of the slot's last use; the use counts serve the frequency policy.
//! Everything is integer arithmetic, so every backend computes the same books bit for bit.

/// Words before the per-slot arrays.
pub const HEADER: usize = 8;
const CLOCK: usize = 0;
const LOOKUPS: usize = 1;
const MISSES: usize = 3;
const STAGED: usize = 5;

/// Which cached expert leaves when a missing one needs its slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SlotPolicy {
    /// The least recently used.
    Lru,
    /// The least often used, counting uses with a weight that halves for every `half_life`
    /// steps of the layer since the expert's last use (old popularity fades); ties go to the
    /// least recently used.
    Frequency { half_life: u32 },
}

impl SlotPolicy {
    /// The policy as kernels take it: the half-life, 0 for LRU.
    pub fn half_life(self) -> u32 {
        match self {
            SlotPolicy::Lru => 0,
            SlotPolicy::Frequency { half_life } => half_life.max(1),
        }
    }
}

/// One use in the fixed-point use counts.
pub const USE: u32 = 256;

/// A use count `age` steps after its last use, with a weight that halves every `half_life`.
pub fn faded(count: u32, age: u32, half_life: u32) -> u32 {
    count.checked_shr(age / half_life.max(1)).unwrap_or(0)
}

/// Words of one copy of the books of a layer with `slots` slots and `experts` experts.
pub fn book_words(slots: usize, experts: usize) -> usize {
    HEADER + 2 * slots + 2 * experts
}

/// Words of the table: the books and their second copy.
pub fn table_words(slots: usize, experts: usize) -> usize {
    2 * book_words(slots, experts)
}

/// What a layer's cache did since its table was zeroed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Distinct experts decode steps asked for.
    pub lookups: u64,
    /// Of those, the ones copied in from host memory.
    pub misses: u64,
    /// Experts longer chunks copied from host memory to their staging area (the cached ones
    /// come from the slots).
    pub staged: u64,
}

fn wide(t: &[u32], at: usize) -> u64 {
    t[at] as u64 | (t[at + 1] as u64) << 32
}

fn add_wide(t: &mut [u32], at: usize, n: u64) {
    let v = wide(t, at).wrapping_add(n);
    t[at] = v as u32;
    t[at + 1] = (v >> 32) as u32;
}

pub fn stats(table: &[u32]) -> TableStats {
    TableStats {
        lookups: wide(table, LOOKUPS),
        misses: wide(table, MISSES),
        staged: wide(table, STAGED),
    }
}

/// A missing expert and the slot it is copied to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fill {
    pub slot: u32,
    pub expert: u32,
}

struct Books<'a> {
    t: &'a mut [u32],
    slots: usize,
    experts: usize,
}

impl Books<'_> {
    fn owner(&self, s: usize) -> u32 {
        self.t[HEADER + s]
    }
    fn stamp(&self, s: usize) -> u32 {
        self.t[HEADER + self.slots + s]
    }
    fn count(&self, e: usize) -> u32 {
        self.t[HEADER + 2 * self.slots + e]
    }
    fn used_at(&self, e: usize) -> u32 {
        self.t[HEADER + 2 * self.slots + self.experts + e]
    }
    fn slot_of(&self, e: u32) -> Option<usize> {
        (0..self.slots).find(|&s| self.owner(s) == e + 1)
    }
    fn hold(&mut self, s: usize, e: u32, clock: u32) {
        self.t[HEADER + s] = e + 1;
        self.t[HEADER + self.slots + s] = clock;
    }
    /// An expert's use count faded to `clock` (what the frequency policy compares).
    fn faded(&self, e: usize, clock: u32, half_life: u32) -> u32 {
        faded(self.count(e), clock.wrapping_sub(self.used_at(e)), half_life)
    }
    fn count_use(&mut self, e: usize, clock: u32, half_life: u32) {
        let c = self.faded(e, clock, half_life).saturating_add(USE);
        self.t[HEADER + 2 * self.slots + e] = c;
        self.t[HEADER + 2 * self.slots + self.experts + e] = clock;
    }
    /// The slot a missing expert takes at `clock`: the free slot of lowest index, else the
    /// policy's victim among the slots this step has not used (ties to the lower index).
    fn victim(&self, clock: u32, policy: SlotPolicy) -> usize {
        let mut best: Option<(usize, u32, u32)> = None;
        for s in 0..self.slots {
            let owner = self.owner(s);
            if owner == 0 {
                return s;
            }
            let age = clock.wrapping_sub(self.stamp(s));
            if age == 0 {
                continue;
            }
            // Lower score leaves first; LRU scores every slot alike and goes by age.
            let score = match policy {
                SlotPolicy::Lru => 0,
                SlotPolicy::Frequency { .. } => self.faded(owner as usize - 1, clock, policy.half_life()),
            };
            let better = match best {
                None => true,
                Some((_, bs, ba)) => score < bs || (score == bs && age > ba),
            };
            if better {
                best = Some((s, score, age));
            }
        }
        best.expect("the step's experts fit the slots, so one is unused")
            .0
    }
}

/// The distinct values of `ids` in order of first appearance; an error names an id that is
/// not an expert.
fn distinct(ids: &[u32], experts: usize) -> Result<Vec<u32>, String> {
    let mut d: Vec<u32> = Vec::new();
    for &e in ids {
        if e as usize >= experts {
            return Err(format!("expert id {e} of {experts} experts"));
        }
        if !d.contains(&e) {
            d.push(e);
        }
    }
    Ok(d)
}

/// One decode step of a layer: gives every expert of `ids` a slot (written to `out`, in the
/// same order), hits keeping theirs and misses taking a free slot or the policy's victim
/// among the slots this step did not use, and returns the misses to copy in, in the order of
/// their first appearance in `ids`.
pub fn resolve(
    table: &mut [u32],
    slots: usize,
    experts: usize,
    policy: SlotPolicy,
    ids: &[u32],
    out: &mut [u32],
) -> Result<Vec<Fill>, String> {
    if table.len() != table_words(slots, experts) || out.len() != ids.len() {
        return Err(format!(
            "expert table of {} words for {slots} slots and {experts} experts",
            table.len()
        ));
    }
    let wanted = distinct(ids, experts)?;
    if wanted.len() > slots {
        return Err(format!("{} experts at once in {slots} slots", wanted.len()));
    }
    let (table, copy) = table.split_at_mut(book_words(slots, experts));
    let clock = table[CLOCK].wrapping_add(1);
    table[CLOCK] = clock;
    add_wide(table, LOOKUPS, wanted.len() as u64);
    let mut b = Books {
        t: table,
        slots,
        experts,
    };
    let mut slot = vec![usize::MAX; wanted.len()];
    for (d, &e) in wanted.iter().enumerate() {
        if let SlotPolicy::Frequency { .. } = policy {
            b.count_use(e as usize, clock, policy.half_life());
        }
        if let Some(s) = b.slot_of(e) {
            b.hold(s, e, clock);
            slot[d] = s;
        }
    }
    let mut fills = Vec::new();
    for (d, &e) in wanted.iter().enumerate() {
        if slot[d] == usize::MAX {
            let s = b.victim(clock, policy);
            b.hold(s, e, clock);
            slot[d] = s;
            fills.push(Fill {
                slot: s as u32,
                expert: e,
            });
        }
    }
    add_wide(b.t, MISSES, fills.len() as u64);
    for (o, e) in out.iter_mut().zip(ids) {
        let d = wanted
            .iter()
            .position(|w| w == e)
            .expect("every id is among the distinct");
        *o = slot[d] as u32;
    }
    copy.copy_from_slice(table);
    Ok(fills)
}

/// Where each expert of a longer chunk comes from when it is staged: every distinct expert of
/// `ids`, in increasing order, with the slot that holds it (None: from host memory). Counts the
/// host copies in the books (not in their copy); they are not otherwise changed (staging is not
/// a use of the slots).
pub fn stage_sources(
    table: &mut [u32],
    slots: usize,
    experts: usize,
    ids: &[u32],
) -> Result<Vec<(u32, Option<u32>)>, String> {
    if table.len() != table_words(slots, experts) {
        return Err(format!(
            "expert table of {} words for {slots} slots and {experts} experts",
            table.len()
        ));
    }
    let mut wanted = distinct(ids, experts)?;
    wanted.sort_unstable();
    let table = &mut table[..book_words(slots, experts)];
    let b = Books {
        t: table,
        slots,
        experts,
    };
    let sources: Vec<(u32, Option<u32>)> = wanted
        .iter()
        .map(|&e| (e, b.slot_of(e).map(|s| s as u32)))
        .collect();
    let from_host = sources.iter().filter(|(_, s)| s.is_none()).count();
    add_wide(table, STAGED, from_host as u64);
    Ok(sources)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(slots: usize, experts: usize) -> Vec<u32> {
        vec![0; table_words(slots, experts)]
    }

    #[test]
    fn hits_keep_their_slots_and_misses_take_free_slots_then_the_least_recent() {
        let (slots, experts) = (3, 8);
        let mut t = table(slots, experts);
        let mut out = [0u32; 2];
        let f = resolve(&mut t, slots, experts, SlotPolicy::Lru, &[5, 2], &mut out).unwrap();
        assert_eq!(out, [0, 1]);
        assert_eq!(f, [Fill { slot: 0, expert: 5 }, Fill { slot: 1, expert: 2 }]);
        // 2 hits, 7 takes the free slot.
        let f = resolve(&mut t, slots, experts, SlotPolicy::Lru, &[2, 7], &mut out).unwrap();
        assert_eq!(out, [1, 2]);
        assert_eq!(f, [Fill { slot: 2, expert: 7 }]);
        // Full: 4 evicts 5 (used at step 1), never 2 or 7's slot pinned by this step.
        let f = resolve(&mut t, slots, experts, SlotPolicy::Lru, &[4, 7], &mut out).unwrap();
        assert_eq!(out, [0, 2]);
        assert_eq!(f, [Fill { slot: 0, expert: 4 }]);
        // Repeats share a slot and count once.
        let mut out3 = [0u32; 3];
        let f = resolve(&mut t, slots, experts, SlotPolicy::Lru, &[4, 4, 4], &mut out3).unwrap();
        assert!(f.is_empty());
        assert_eq!(out3, [0, 0, 0]);
        let s = stats(&t);
        assert_eq!((s.lookups, s.misses, s.staged), (7, 4, 0));
    }

    #[test]
    fn the_frequency_policy_keeps_the_often_used() {
        let (slots, experts) = (2, 8);
        let policy = SlotPolicy::Frequency { half_life: 100 };
        let mut t = table(slots, experts);
        let mut out = [0u32; 1];
        for _ in 0..5 {
            resolve(&mut t, slots, experts, policy, &[1], &mut out).unwrap();
        }
        resolve(&mut t, slots, experts, policy, &[2], &mut out).unwrap();
        // 3 misses: LRU would evict 1 (older); frequency evicts 2 (used once).
        let f = resolve(&mut t, slots, experts, policy, &[3], &mut out).unwrap();
        assert_eq!(f, [Fill { slot: 1, expert: 3 }]);
        let mut lru = table(slots, experts);
        for e in [1, 1, 1, 1, 1, 2] {
            resolve(&mut lru, slots, experts, SlotPolicy::Lru, &[e], &mut out).unwrap();
        }
        let f = resolve(&mut lru, slots, experts, SlotPolicy::Lru, &[3], &mut out).unwrap();
        assert_eq!(f, [Fill { slot: 0, expert: 3 }]);
    }

    #[test]
    fn too_many_experts_or_a_bad_id_is_an_error() {
        let mut t = table(2, 8);
        let mut out = [0u32; 3];
        assert!(resolve(&mut t, 2, 8, SlotPolicy::Lru, &[1, 2, 3], &mut out).is_err());
        assert!(resolve(&mut t, 2, 8, SlotPolicy::Lru, &[1, 9, 1], &mut out).is_err());
        assert!(stage_sources(&mut t, 2, 8, &[8]).is_err());
    }

    #[test]
    fn staging_takes_cached_experts_from_their_slots() {
        let (slots, experts) = (2, 8);
        let mut t = table(slots, experts);
        let mut out = [0u32; 2];
        resolve(&mut t, slots, experts, SlotPolicy::Lru, &[6, 3], &mut out).unwrap();
        let src = stage_sources(&mut t, slots, experts, &[7, 3, 6, 7, 0]).unwrap();
        assert_eq!(src, [(0, None), (3, Some(1)), (6, Some(0)), (7, None)]);
        assert_eq!(stats(&t).staged, 2);
    }
}
