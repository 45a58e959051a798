//! The books of a pool of KV blocks with prefix caching: which blocks are free, how many
//! sequences use each, and which full blocks hold a known prefix's keys and values, found by a
//! hash of every token from position 0 to the block's end (chained block by block, as vLLM
//! does), so a new sequence that starts with the same tokens reuses them instead of computing
//! them again. A full block is never written again, so sequences share it as it is. Free blocks
//! keep what they hold until they are taken for something else, the least recently freed first.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hash, Hasher};

use kestrel_model::KV_BLOCK;

/// The hash of the prefix before the first block.
pub const ROOT: u64 = 0;

pub struct Blocks {
    total: usize,
    /// Blocks from this one on were never taken: they are taken first, in order, and the books
    /// grow as they are (a pool's books cost nothing before it is used).
    fresh: usize,
    /// Free blocks taken before, least recently freed first.
    free: VecDeque<u32>,
    /// Sequences using each block taken so far.
    refs: Vec<u32>,
    /// What each full block holds, when it was registered: its prefix's hash, the hash before
    /// it and its tokens (a hash found is checked against them).
    held: Vec<Option<(u64, u64, [u32; KV_BLOCK])>>,
    by_hash: HashMap<u64, u32>,
    /// Keyed afresh for each pool, so nobody can make two prefixes' hashes meet on purpose.
    keys: RandomState,
}

impl Blocks {
    pub fn new(blocks: usize) -> Blocks {
        Blocks {
            total: blocks,
            fresh: 0,
            free: VecDeque::new(),
            refs: Vec::new(),
            held: Vec::new(),
            by_hash: HashMap::new(),
            keys: RandomState::new(),
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// Blocks some sequence uses.
    pub fn used(&self) -> usize {
        self.fresh - self.free.len()
    }

    /// The hash of the prefix ending with `tokens` (one block's) after the prefix `parent`.
    pub fn chain(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut h = self.keys.build_hasher();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        // ROOT stays the hash of no prefix.
        h.finish().max(1)
    }

    /// A free block for a sequence (forgetting what it held), or None when none is free.
    pub fn take(&mut self) -> Option<u32> {
        if self.fresh < self.total {
            self.fresh += 1;
            self.refs.push(1);
            self.held.push(None);
            return Some(self.fresh as u32 - 1);
        }
        let b = self.free.pop_front()?;
        if let Some((hash, _, _)) = self.held[b as usize].take() {
            if self.by_hash.get(&hash) == Some(&b) {
                self.by_hash.remove(&hash);
            }
        }
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// The block holding the prefix `parent` followed by `tokens`, one use more, if one does.
    pub fn find(&mut self, parent: u64, tokens: &[u32]) -> Option<(u32, u64)> {
        let hash = self.chain(parent, tokens);
        let &b = self.by_hash.get(&hash)?;
        match &self.held[b as usize] {
            Some((h, p, t)) if *h == hash && *p == parent && t[..] == *tokens => {}
            _ => return None,
        }
        if self.refs[b as usize] == 0 {
            let at = self
                .free
                .iter()
                .position(|&f| f == b)
                .expect("an unused block is free");
            self.free.remove(at);
        }
        self.refs[b as usize] += 1;
        Some((b, hash))
    }

    /// Records that block `b`, now full, holds the prefix `parent` followed by `tokens`; returns
    /// that prefix's hash. (Where another block holds it already, that one stays the one found.)
    pub fn register(&mut self, b: u32, parent: u64, tokens: &[u32]) -> u64 {
        let hash = self.chain(parent, tokens);
        let mut t = [0u32; KV_BLOCK];
        t.copy_from_slice(tokens);
        self.held[b as usize] = Some((hash, parent, t));
        self.by_hash.entry(hash).or_insert(b);
        hash
    }

    /// Sequences using block `b`.
    pub fn uses(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }

    /// One use of block `b` less; unused, it is free (and still holds its prefix).
    pub fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push_back(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(start: u32) -> Vec<u32> {
        (start..start + KV_BLOCK as u32).collect()
    }

    #[test]
    fn a_registered_prefix_is_found_until_its_block_is_taken_again() {
        let mut b = Blocks::new(3);
        let x = b.take().unwrap();
        let h = b.register(x, ROOT, &block(0));
        // Found while in use, and after: one use more each time.
        assert_eq!(b.find(ROOT, &block(0)), Some((x, h)));
        b.release(x);
        assert_eq!(b.used(), 1);
        b.release(x);
        assert_eq!(b.used(), 0);
        assert_eq!(
            b.find(ROOT, &block(0)),
            Some((x, h)),
            "a free block keeps its prefix"
        );
        assert_eq!(b.used(), 1);
        b.release(x);
        // Other tokens, or the same tokens after another prefix, are not it.
        assert_eq!(b.find(ROOT, &block(1)), None);
        assert_eq!(b.find(h, &block(0)), None);
        // The least recently freed go first: x is taken last, and then forgets its prefix.
        let (y, z) = (b.take().unwrap(), b.take().unwrap());
        assert!(y != x && z != x);
        assert_eq!(b.take(), Some(x));
        assert_eq!(b.take(), None);
        assert_eq!(b.find(ROOT, &block(0)), None);
    }

    #[test]
    fn a_chain_depends_on_every_block_before() {
        let b = Blocks::new(1);
        let one = b.chain(ROOT, &block(0));
        assert_ne!(
            b.chain(one, &block(16)),
            b.chain(b.chain(ROOT, &block(1)), &block(16))
        );
        assert_ne!(one, ROOT);
    }
}
