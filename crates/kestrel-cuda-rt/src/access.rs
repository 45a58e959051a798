//! Access ranges and the dependency analysis built on them.
//!
//! Every dispatch declares the byte ranges it reads and writes, each on one allocation. Two
//! dispatches conflict when they touch overlapping bytes of the same allocation and at least one
//! of them writes (read-after-write, write-after-read, write-after-write). [`DepGraph::infer`]
//! turns a recorded sequence into the smallest set of edges that orders every conflicting pair
//! as recorded; dispatches with no path between them may run concurrently. The CUDA graph
//! builder uses this analysis.

use std::collections::HashMap;
use std::fmt;

/// Identity of one device allocation; views of the same allocation share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocId(pub u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AccessMode {
    Read,
    Write,
    ReadWrite,
}

impl AccessMode {
    pub fn reads(self) -> bool {
        matches!(self, AccessMode::Read | AccessMode::ReadWrite)
    }

    pub fn writes(self) -> bool {
        matches!(self, AccessMode::Write | AccessMode::ReadWrite)
    }
}

/// One byte range `[start, end)` of one allocation, with how it is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Access {
    pub alloc: AllocId,
    pub start: u64,
    pub end: u64,
    pub mode: AccessMode,
}

impl Access {
    pub fn new(alloc: AllocId, start: u64, len: u64, mode: AccessMode) -> Self {
        Access {
            alloc,
            start,
            end: start + len,
            mode,
        }
    }

    /// True when both touch at least one common byte of the same allocation.
    pub fn overlaps(&self, other: &Access) -> bool {
        self.alloc == other.alloc && self.start < other.end && other.start < self.end
    }

    /// The hazard that orders `self` (earlier) before `later`, if any.
    pub fn hazard_before(&self, later: &Access) -> Option<Hazard> {
        if !self.overlaps(later) {
            return None;
        }
        match (self.mode.writes(), later.mode.writes()) {
            (true, true) => Some(Hazard::WriteAfterWrite),
            (true, false) => Some(Hazard::ReadAfterWrite),
            (false, true) => Some(Hazard::WriteAfterRead),
            (false, false) => None,
        }
    }
}

/// Why one dispatch must wait for an earlier one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Hazard {
    ReadAfterWrite,
    WriteAfterRead,
    WriteAfterWrite,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hazard::ReadAfterWrite => "RAW",
            Hazard::WriteAfterRead => "WAR",
            Hazard::WriteAfterWrite => "WAW",
        })
    }
}

/// An edge `from -> to` with `from < to` in recording order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Edge {
    pub from: usize,
    pub to: usize,
    pub hazard: Hazard,
}

/// The dependency graph of a recorded sequence of dispatches, transitively reduced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DepGraph {
    edges: Vec<Edge>,
    /// `preds[j]`: direct predecessors of node `j`, ascending.
    preds: Vec<Vec<usize>>,
}

/// A fixed-size bit set over node indices.
#[derive(Clone)]
struct Bits(Vec<u64>);

impl Bits {
    fn new(n: usize) -> Self {
        Bits(vec![0; n.div_ceil(64)])
    }
    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
    fn get(&self, i: usize) -> bool {
        self.0[i / 64] >> (i % 64) & 1 == 1
    }
    fn union(&mut self, other: &Bits) {
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a |= b;
        }
    }
}

impl DepGraph {
    /// Infers the edges of `nodes`, each given as the accesses of one dispatch, in the order
    /// they were recorded.
    pub fn infer<A: AsRef<[Access]>>(nodes: &[A]) -> DepGraph {
        let n = nodes.len();
        // Every earlier access per allocation: (node, access).
        let mut history: HashMap<AllocId, Vec<(usize, Access)>> = HashMap::new();
        // ancestors[j]: every node that must finish before j, through any path.
        let mut ancestors: Vec<Bits> = Vec::with_capacity(n);
        let mut preds = Vec::with_capacity(n);
        let mut edges = Vec::new();

        for (j, accesses) in nodes.iter().enumerate() {
            let accesses = accesses.as_ref();
            let mut candidates: Vec<(usize, Hazard)> = Vec::new();
            for a in accesses {
                if let Some(prior) = history.get(&a.alloc) {
                    for (i, p) in prior {
                        if let Some(h) = p.hazard_before(a) {
                            candidates.push((*i, h));
                        }
                    }
                }
            }
            // Latest first: an earlier candidate reachable through a later one is redundant,
            // and every path to j enters through a direct predecessor with a larger index.
            candidates.sort_by_key(|c| std::cmp::Reverse(c.0));
            candidates.dedup_by_key(|c| c.0);
            let mut anc = Bits::new(n);
            let mut mine = Vec::new();
            for (i, hazard) in candidates {
                if anc.get(i) {
                    continue;
                }
                anc.set(i);
                anc.union(&ancestors[i]);
                mine.push(i);
                edges.push(Edge {
                    from: i,
                    to: j,
                    hazard,
                });
            }
            mine.reverse();
            preds.push(mine);
            ancestors.push(anc);
            for a in accesses {
                history.entry(a.alloc).or_default().push((j, *a));
            }
        }
        edges.sort_by_key(|e| (e.to, e.from));
        DepGraph { edges, preds }
    }

    pub fn node_count(&self) -> usize {
        self.preds.len()
    }

    pub fn edges(&self) -> &[Edge] {
        &self.edges
    }

    /// Direct predecessors of `node`, ascending.
    pub fn preds(&self, node: usize) -> &[usize] {
        &self.preds[node]
    }

    /// True when a path of edges leads from `from` to `to`.
    pub fn reaches(&self, from: usize, to: usize) -> bool {
        if from >= to {
            return false;
        }
        let mut seen = Bits::new(self.node_count());
        let mut stack = vec![to];
        while let Some(k) = stack.pop() {
            for &p in &self.preds[k] {
                if p == from {
                    return true;
                }
                if p > from && !seen.get(p) {
                    seen.set(p);
                    stack.push(p);
                }
            }
        }
        false
    }

    /// The number of nodes on the longest chain; a measure of how serial the graph is.
    pub fn critical_path_len(&self) -> usize {
        let mut depth = vec![0usize; self.node_count()];
        for j in 0..self.node_count() {
            depth[j] = 1 + self.preds[j].iter().map(|&p| depth[p]).max().unwrap_or(0);
        }
        depth.into_iter().max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_core::rng::Rng;
    use AccessMode::*;

    fn acc(alloc: u64, start: u64, len: u64, mode: AccessMode) -> Access {
        Access::new(AllocId(alloc), start, len, mode)
    }

    fn edge_list(g: &DepGraph) -> Vec<(usize, usize, Hazard)> {
        g.edges().iter().map(|e| (e.from, e.to, e.hazard)).collect()
    }

    #[test]
    fn planted_raw_war_waw() {
        // 0 writes A; 1 reads A (RAW on 0); 2 writes B; 3 writes B (WAW on 2);
        // 4 writes A (WAR on 1, and WAW on 0 which is already implied through 1).
        let g = DepGraph::infer(&[
            vec![acc(1, 0, 64, Write)],
            vec![acc(1, 0, 64, Read)],
            vec![acc(2, 0, 64, Write)],
            vec![acc(2, 0, 64, Write)],
            vec![acc(1, 0, 64, Write)],
        ]);
        assert_eq!(
            edge_list(&g),
            vec![
                (0, 1, Hazard::ReadAfterWrite),
                (2, 3, Hazard::WriteAfterWrite),
                (1, 4, Hazard::WriteAfterRead),
            ]
        );
        assert!(g.reaches(0, 4));
        assert!(!g.reaches(0, 3));
    }

    #[test]
    fn reads_do_not_conflict() {
        let g = DepGraph::infer(&[
            vec![acc(1, 0, 64, Read)],
            vec![acc(1, 0, 64, Read)],
            vec![acc(1, 16, 8, Read)],
        ]);
        assert!(g.edges().is_empty());
        assert_eq!(g.critical_path_len(), 1);
    }

    #[test]
    fn disjoint_views_of_one_allocation_do_not_conflict() {
        // Two halves written independently, then one reader of the whole buffer.
        let g = DepGraph::infer(&[
            vec![acc(7, 0, 512, Write)],
            vec![acc(7, 512, 512, Write)],
            vec![acc(7, 0, 1024, Read)],
        ]);
        assert_eq!(
            edge_list(&g),
            vec![(0, 2, Hazard::ReadAfterWrite), (1, 2, Hazard::ReadAfterWrite)]
        );
        // Adjacent ranges share no byte.
        assert!(!acc(7, 0, 512, Write).overlaps(&acc(7, 512, 1, Write)));
        assert!(acc(7, 0, 513, Write).overlaps(&acc(7, 512, 1, Write)));
        // Same offsets in different allocations never conflict.
        assert!(!acc(7, 0, 512, Write).overlaps(&acc(8, 0, 512, Write)));
    }

    #[test]
    fn read_write_chain_is_serial_and_reduced() {
        let nodes: Vec<_> = (0..10).map(|_| vec![acc(3, 0, 4, ReadWrite)]).collect();
        let g = DepGraph::infer(&nodes);
        assert_eq!(g.edges().len(), 9, "only consecutive edges remain");
        assert_eq!(g.critical_path_len(), 10);
        assert!(g.reaches(0, 9));
    }

    #[test]
    fn diamond() {
        // 0 writes X; 1 and 2 read X and write Y0, Y1; 3 reads Y0 and Y1.
        let g = DepGraph::infer(&[
            vec![acc(1, 0, 8, Write)],
            vec![acc(1, 0, 8, Read), acc(2, 0, 8, Write)],
            vec![acc(1, 0, 8, Read), acc(3, 0, 8, Write)],
            vec![acc(2, 0, 8, Read), acc(3, 0, 8, Read)],
        ]);
        assert_eq!(g.preds(3), &[1, 2]);
        assert_eq!(g.preds(1), &[0]);
        assert_eq!(g.preds(2), &[0]);
        assert_eq!(g.critical_path_len(), 3);
    }

    /// Property test on random sequences: every conflicting pair is ordered, every edge is a
    /// real conflict, and no edge is implied by the others.
    #[test]
    fn random_sequences_order_exactly_the_conflicts() {
        let (mut rng, seed) = Rng::from_time();
        for round in 0..200 {
            let n = rng.range(1, 40);
            let nodes: Vec<Vec<Access>> = (0..n)
                .map(|_| {
                    (0..rng.range(1, 4))
                        .map(|_| {
                            let mode = [Read, Write, ReadWrite][rng.range(0, 3)];
                            acc(
                                rng.range(0, 3) as u64,
                                rng.range(0, 100) as u64,
                                rng.range(1, 30) as u64,
                                mode,
                            )
                        })
                        .collect()
                })
                .collect();
            let g = DepGraph::infer(&nodes);
            let conflict = |i: usize, j: usize| {
                nodes[i]
                    .iter()
                    .any(|a| nodes[j].iter().any(|b| a.hazard_before(b).is_some()))
            };
            for j in 0..n {
                for i in 0..j {
                    if conflict(i, j) {
                        assert!(g.reaches(i, j), "seed {seed} round {round}: {i}->{j} unordered");
                    }
                }
            }
            for e in g.edges() {
                assert!(
                    conflict(e.from, e.to),
                    "seed {seed} round {round}: spurious {e:?}"
                );
                // Redundant if some other predecessor of `to` already reaches `from`.
                let implied = g.preds(e.to).iter().any(|&p| p != e.from && g.reaches(e.from, p));
                assert!(!implied, "seed {seed} round {round}: redundant {e:?}");
            }
        }
    }
}
