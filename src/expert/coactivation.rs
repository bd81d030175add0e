//! Expert order on storage by co-activation (`les pack --order coactivation --routes FILE...`):
//! within each MoE layer, experts that the router picks in the same forward are placed next to
//! each other, so the streaming reader can fetch several wanted experts with one read
//! ([`crate::store::ByteSource::read_at`] over the span of adjacent blocks).
//!
//! From routing traces (`les run --routes`: every routed `[layer, expert]` in order; a forward's
//! experts of one layer are consecutive entries), per layer: each expert's routing count and,
//! for each pair, the number of forwards that routed both (prompt batches count once each, as one
//! forward). The order is a greedy chain: the most routed expert first, then repeatedly the
//! unplaced expert routed most often together with the last placed one (ties: the most routed,
//! then the lowest index); experts never routed go last in index order.

/// Per layer, the experts in storage order (a permutation of `0..n_expert`).
pub fn coactivation_order(traces: &[Vec<(u32, u32)>], n_layers: usize, n_expert: usize) -> Vec<Vec<usize>> {
    let mut freq = vec![vec![0u64; n_expert]; n_layers];
    let mut co = vec![vec![0u64; n_expert * n_expert]; n_layers];
    for t in traces {
        let mut i = 0;
        while i < t.len() {
            let l = t[i].0 as usize;
            let mut j = i;
            while j < t.len() && t[j].0 as usize == l {
                j += 1;
            }
            if l < n_layers {
                let mut group: Vec<usize> = t[i..j].iter().map(|x| x.1 as usize).filter(|&e| e < n_expert).collect();
                group.sort_unstable();
                group.dedup();
                for (a_i, &a) in group.iter().enumerate() {
                    freq[l][a] += 1;
                    for &b in &group[a_i + 1..] {
                        co[l][a * n_expert + b] += 1;
                        co[l][b * n_expert + a] += 1;
                    }
                }
            }
            i = j;
        }
    }
    (0..n_layers)
        .map(|l| {
            let (f, c) = (&freq[l], &co[l]);
            let mut placed = vec![false; n_expert];
            let mut order = Vec::with_capacity(n_expert);
            let first = (0..n_expert).filter(|&e| f[e] > 0).max_by_key(|&e| (f[e], std::cmp::Reverse(e)));
            if let Some(mut last) = first {
                placed[last] = true;
                order.push(last);
                while let Some(next) = (0..n_expert).filter(|&e| !placed[e] && f[e] > 0).max_by_key(|&e| (c[last * n_expert + e], f[e], std::cmp::Reverse(e))) {
                    placed[next] = true;
                    order.push(next);
                    last = next;
                }
            }
            order.extend((0..n_expert).filter(|&e| !placed[e]));
            order
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experts_routed_together_sit_together() {
        // Each forward routes two experts of layer 0 and {3, 0} of layer 1; layer 0's pairs:
        // {5, 2} three times, {7, 1} twice, {2, 7} once.
        let fw = |pairs: &[(u32, u32)]| pairs.iter().flat_map(|&(a, b)| [(0, a), (0, b), (1, 3), (1, 0)]).collect::<Vec<_>>();
        let trace = fw(&[(5, 2), (2, 5), (5, 2), (7, 1), (1, 7), (2, 7)]);
        let o = coactivation_order(&[trace], 2, 8);
        // 2 is the most routed (4): then 5 (3 together), then 7 (no co-routing with 5: the most
        // routed left, 3), then 1 (2 together with 7); the never-routed in index order.
        assert_eq!(o[0], vec![2, 5, 7, 1, 0, 3, 4, 6]);
        // Layer 1: 0 and 3 tie on counts: the lower index first.
        assert_eq!(o[1][..2], [0, 3]);
        for p in &o {
            let mut s = p.clone();
            s.sort_unstable();
            assert_eq!(s, (0..8).collect::<Vec<_>>());
        }
    }
}
