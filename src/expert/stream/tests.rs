//! Tests of the streaming cache with real reads (a slow store, a page-like asynchronous reader).

use super::*;
use crate::expert::ExpertLayout;
use crate::quant::GgmlType;

/// Experts of `bytes` per matrix whose byte i is `(layer·7 + expert·3 + i) mod 251`; every
/// range read sleeps `delay` (a slow device).
struct SlowStore {
    layout: ExpertLayout,
    n_layers: usize,
    delay: std::time::Duration,
    /// What [`ExpertStore::serves_in_order`] answers.
    in_order: bool,
    /// Every range read: (layer, start, end).
    log: Mutex<Vec<(usize, Instant, Instant)>>,
}

impl SlowStore {
    fn byte(layer: usize, expert: usize, i: usize) -> u8 {
        ((layer * 7 + expert * 3 + i) % 251) as u8
    }
}

impl ExpertStore for SlowStore {
    fn n_layers(&self) -> usize {
        self.n_layers
    }
    fn layout(&self, _layer: usize) -> &ExpertLayout {
        &self.layout
    }
    fn ranges(&self, layer: usize, expert: usize) -> Result<Vec<(u64, usize)>, ExpertError> {
        // Offsets encode (layer, expert) so read_range can fill the right bytes.
        let base = ((layer * 64 + expert) as u64) << 32;
        let b = self.layout.gate_bytes;
        Ok((0..3).map(|m| (base + (m * b) as u64, b)).collect())
    }
    fn read_range(&self, l: usize, _e: usize, off: u64, buf: &mut [u8]) -> Result<(), ExpertError> {
        let t = Instant::now();
        std::thread::sleep(self.delay);
        let (key, at) = ((off >> 32) as usize, (off & 0xffff_ffff) as usize);
        for (i, v) in buf.iter_mut().enumerate() {
            *v = Self::byte(key / 64, key % 64, at + i);
        }
        self.log.lock().unwrap().push((l, t, Instant::now()));
        Ok(())
    }
    fn serves_in_order(&self) -> bool {
        self.in_order
    }
    fn reads_per_expert(&self) -> usize {
        3
    }
    fn name(&self) -> &'static str {
        "slow test store"
    }
}

/// A [`SlowStore`] of `n_layers` layers of 4 experts (4-wide, F32, `bytes` per matrix) and a
/// router whose rows are unit vectors: a hidden state along axis k routes to expert k.
fn unit_router_store(bytes: usize, n_layers: usize, delay_ms: u64) -> (Arc<SlowStore>, Vec<f32>, usize) {
    let (n_embd, n_expert) = (4, 4);
    let layout = ExpertLayout { n_embd, n_ff: 1, gate_ty: GgmlType::F32, up_ty: GgmlType::F32, down_ty: GgmlType::F32, gate_bytes: bytes, up_bytes: bytes, down_bytes: bytes };
    let store = Arc::new(SlowStore { layout, n_layers, delay: std::time::Duration::from_millis(delay_ms), in_order: false, log: Mutex::new(Vec::new()) });
    let router = (0..n_expert * n_embd).map(|i| if i / n_embd == i % n_embd { 1.0 } else { 0.0 }).collect();
    (store, router, n_expert)
}

/// A prefetch in flight yields to a demand read between its chunks and resumes later, and the
/// expert it finally hands over has exactly the store's bytes.
#[test]
fn chunked_prefetch_yields_to_a_demand_read_and_resumes() {
    let bytes = 64 << 10;
    let (store, router, n_expert) = unit_router_store(bytes, 3, 2);
    let cfg = StreamConfig { slots: 8, prefetch: true, depth: 2, temporal: false, io_threads: 3, max_prefetch_inflight: 1, prefetch_chunk: 2048, ..Default::default() };
    let ex = StreamingExperts::new(store, vec![router; 3], n_expert, 1, cfg);
    // Layer 0 decides expert 0; its hidden state predicts expert 2 for layers 1 and 2.
    ex.on_hidden(0, &[0.0, 0.0, 1.0, 0.0], 1);
    ex.with_experts(0, &[0], &mut |_, _| {}).unwrap();
    // Wait until the layer-1 prefetch is done (96 chunks × 2 ms) and the layer-2 one has read
    // a chunk (it then needs about 190 ms more): polled, not slept, so a loaded machine
    // cannot reorder the steps.
    let t0 = std::time::Instant::now();
    loop {
        let s = ex.stats();
        if s.prefetch_loads >= 1 && s.bytes_read > 6 * bytes as u64 {
            break;
        }
        assert!(t0.elapsed().as_secs() < 20, "prefetches did not progress: {s:?}");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // Layer 1 needs expert 2 (prefetched) and expert 3 (a demand read): the layer-2
    // prefetch in flight must pause for it.
    let mut seen = Vec::new();
    ex.with_experts(1, &[2, 3], &mut |i, b| seen.push((i, b.data.clone()))).unwrap();
    let s = ex.stats();
    assert!(s.prefetch_yields > 0, "the layer-2 prefetch did not yield: {s:?}");
    let mut got = None;
    ex.with_experts(2, &[2], &mut |_, b| got = Some(b.data.clone())).unwrap();
    let want: Vec<u8> = (0..3 * bytes).map(|i| SlowStore::byte(2, 2, i)).collect();
    assert_eq!(got.unwrap(), want, "a resumed prefetch must hold exactly the store's bytes");
    for (i, data) in seen {
        let e = [2, 3][i];
        let want: Vec<u8> = (0..3 * bytes).map(|j| SlowStore::byte(1, e, j)).collect();
        assert_eq!(data, want);
    }
    assert_eq!(ex.stats().load_failures, 0);
}

/// A prefetch waits while a demand read is in flight, unless the store serves reads in
/// submission order: then it starts at once (queued behind the demand read on the device).
#[test]
fn prefetch_overlaps_a_demand_read_only_on_a_store_that_serves_in_order() {
    for in_order in [false, true] {
        let (store, router, n_expert) = unit_router_store(4 << 10, 2, 40);
        let store = Arc::new(SlowStore { in_order, log: Mutex::new(Vec::new()), ..Arc::into_inner(store).unwrap() });
        let cfg = StreamConfig { slots: 8, prefetch: true, adaptive: false, depth: 1, temporal: false, refine: false, io_threads: 3, ..Default::default() };
        let ex = StreamingExperts::new(store.clone(), vec![router; 2], n_expert, 1, cfg);
        // Layer 0's FFN input predicts expert 2 for layer 1 (queued once layer 0's own
        // expert 0, a demand read of 3 × 40 ms, has its slot).
        ex.on_hidden(0, &[0.0, 0.0, 1.0, 0.0], 1);
        ex.with_experts(0, &[0], &mut |_, _| {}).unwrap();
        ex.with_experts(1, &[2], &mut |_, _| {}).unwrap();
        let log = store.log.lock().unwrap().clone();
        let demand_end = log.iter().filter(|r| r.0 == 0).map(|r| r.2).max().unwrap();
        let prefetch_start = log.iter().filter(|r| r.0 == 1).map(|r| r.1).min().unwrap();
        assert_eq!(prefetch_start < demand_end, in_order, "in_order {in_order}: {log:?}");
    }
}

/// Refinement: a partial layer output that routes layer 1 elsewhere replaces the first
/// stage's queued (not started) prefetch, and its pick is what layer 1 finds resident.
#[test]
fn refinement_replaces_a_queued_prefetch() {
    let (store, router, n_expert) = unit_router_store(4 << 10, 2, 20);
    let cfg = StreamConfig { slots: 8, prefetch: true, depth: 1, temporal: false, io_threads: 3, refine: true, ..Default::default() };
    let ex = Arc::new(StreamingExperts::new(store, vec![router; 2], n_expert, 1, cfg));
    // Layer 0's FFN input predicts expert 2 for layer 1; its own expert 0 is a demand read
    // (3 × 20 ms), so the prefetch waits in the queue.
    ex.on_hidden(0, &[0.0, 0.0, 1.0, 0.0], 1);
    let ex2 = ex.clone();
    let h = std::thread::spawn(move || ex2.with_experts(0, &[0], &mut |_, _| {}));
    std::thread::sleep(std::time::Duration::from_millis(15));
    // The partial output routes layer 1 to expert 3.
    ex.on_partial(0, &[0.0, 0.0, 0.0, 1.0]);
    h.join().unwrap().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(150));
    let resident = ex.resident();
    assert!(resident.contains(&(1, 3)), "refined pick not loaded: {resident:?}");
    assert!(!resident.contains(&(1, 2)), "the dropped first-stage prefetch was loaded: {resident:?}");
    ex.with_experts(1, &[3], &mut |_, _| {}).unwrap();
    let s = ex.stats();
    assert_eq!((s.refine_pred_tp, s.refine_pred_made, s.refine_pred_routed), (1, 1, 1));
    assert_eq!((s.layers[1].hits, s.layers[1].misses), (1, 0));
    assert_eq!(s.recall(1), 0.0, "the first stage's own recall stays separate");
}

/// A reader like the browser page's: a read submitted now finishes at the second poll after
/// it (or at `wait`, when it may block); every `refuse_every`-th submission is refused. A
/// `direct` one writes a read's bytes into the destination given at submission when the read
/// finishes (as the I/O worker writes into the shared wasm memory), and `take` copies nothing.
struct PageReader {
    store: Arc<SlowStore>,
    /// (id, ranges, polls seen, destination address or 0).
    pending: Mutex<Vec<(u32, Vec<(u64, usize)>, u32, usize)>>,
    done: Mutex<HashMap<u32, (Vec<(u64, usize)>, usize)>>,
    direct: bool,
    submits: std::sync::atomic::AtomicUsize,
    can_block: bool,
    refuse_every: usize,
    max_piece: usize,
    /// Every this-many-th finished read fails (0: none).
    fail_every: usize,
    takes: std::sync::atomic::AtomicUsize,
}

impl PageReader {
    fn read_into(&self, ranges: &[(u64, usize)], dest: &mut [u8]) -> Result<(), String> {
        assert_eq!(ranges.iter().map(|r| r.1).sum::<usize>(), dest.len());
        let mut at = 0;
        for &(off, len) in ranges {
            self.store.read_range(0, 0, off, &mut dest[at..at + len]).map_err(|e| e.to_string())?;
            at += len;
        }
        Ok(())
    }

    /// A read finishes: a direct one lands in its destination now.
    fn finish(&self, id: u32, ranges: Vec<(u64, usize)>, dest: usize) {
        if dest != 0 {
            let len = ranges.iter().map(|r| r.1).sum();
            // SAFETY: the executor keeps the destination for this read until it is taken or
            // cancelled (what the test checks: every expert handed over has the store's bytes).
            let d = unsafe { std::slice::from_raw_parts_mut(dest as *mut u8, len) };
            self.read_into(&ranges, d).unwrap();
        }
        self.done.lock().unwrap().insert(id, (ranges, dest));
    }
}

impl AsyncReader for Arc<PageReader> {
    fn submit(&self, id: u32, ranges: &[(u64, usize)], dest: Option<*mut u8>) -> bool {
        let n = self.submits.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if n % self.refuse_every == 0 {
            return false;
        }
        assert!(ranges.iter().map(|r| r.1).sum::<usize>() <= self.max_piece());
        assert_eq!(dest.is_some(), self.direct, "a destination is given to direct readers only");
        self.pending.lock().unwrap().push((id, ranges.to_vec(), 0, dest.map_or(0, |p| p as usize)));
        true
    }
    fn direct(&self) -> bool {
        self.direct
    }
    fn poll(&self) -> Vec<u32> {
        let mut finished = Vec::new();
        self.pending.lock().unwrap().retain_mut(|(id, ranges, age, dest)| {
            *age += 1;
            if *age < 2 {
                return true;
            }
            finished.push((*id, std::mem::take(ranges), *dest));
            false
        });
        finished
            .into_iter()
            .map(|(id, ranges, dest)| {
                self.finish(id, ranges, dest);
                id
            })
            .collect()
    }
    fn take(&self, id: u32, dest: &mut [u8]) -> Result<(), String> {
        let (ranges, into) = self.done.lock().unwrap().remove(&id).ok_or("not finished")?;
        let n = self.takes.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if self.fail_every > 0 && n % self.fail_every == 0 {
            return Err("injected read failure".into());
        }
        if into != 0 {
            assert_eq!((into, ranges.iter().map(|r| r.1).sum::<usize>()), (dest.as_ptr() as usize, dest.len()), "a direct read is taken where it went");
            return Ok(());
        }
        self.read_into(&ranges, dest)
    }
    fn wait(&self, id: u32) -> bool {
        if !self.can_block {
            return false;
        }
        let found = {
            let mut p = self.pending.lock().unwrap();
            p.iter().position(|x| x.0 == id).map(|i| p.remove(i))
        };
        if let Some((id, ranges, _, dest)) = found {
            self.finish(id, ranges, dest);
        }
        true
    }
    fn cancel(&self, id: u32) {
        // A direct read is not written after it is cancelled (the page waits for a busy one).
        self.pending.lock().unwrap().retain(|x| x.0 != id);
        self.done.lock().unwrap().remove(&id);
    }
    fn max_piece(&self) -> usize {
        self.max_piece
    }
    fn describe(&self) -> String {
        "test page".into()
    }
}

/// The browser's executor ([`AsyncIo`]) against a page-like reader: reads shorter than one
/// range and reads spanning several ranges, reads that land only at later layers, refused
/// submissions (dropped prefetches), pieces the router waits for (blocked on, or abandoned and
/// read here), failed reads (a failed prefetch costs nothing: the expert is read on demand if
/// the router picks it), direct reads into the slots. Every expert handed to the model has
/// exactly the store's bytes, and prefetches do load.
#[test]
fn asynchronous_reads_hand_over_the_stores_bytes() {
    // The last case starts with native I/O threads: replacing them must stop them (not hang).
    for (can_block, max_piece, io_threads, fail_every, direct) in [
        (true, 3000, 0, 0, false),
        (false, 3000, 0, 0, false),
        (true, 12000, 0, 0, false),
        (false, 12000, 2, 0, false),
        (true, 12000, 0, 3, false),
        (false, 3000, 0, 4, false),
        (true, 3000, 0, 0, true),
        (false, 12000, 0, 0, true),
        (true, 12000, 0, 3, true),
    ] {
        let bytes = 5000;
        let (store, router, n_expert) = unit_router_store(bytes, 3, 0);
        let cfg = StreamConfig { slots: 5, prefetch: true, depth: 2, temporal: true, io_threads, prefetch_chunk: 2048, ..Default::default() };
        let ex = StreamingExperts::new(store.clone(), vec![router.clone(); 3], n_expert, 1, cfg);
        let reader = Arc::new(PageReader { store, pending: Mutex::new(Vec::new()), done: Mutex::new(HashMap::new()), direct, submits: Default::default(), can_block, refuse_every: 7, max_piece, fail_every, takes: Default::default() });
        ex.use_async_reader(reader.clone(), 2);
        assert!(ex.executor().contains("test page"));
        let mut handed = 0;
        for t in 0..40usize {
            for layer in 0..3usize {
                // Routed expert and a hidden state that predicts the next layer's pick
                // right two times in three.
                let e = (t * 5 + layer * 3) % n_expert;
                let next = (t * 5 + (layer + 1) * 3 + usize::from(t % 3 == 0)) % n_expert;
                let mut h = vec![0.0f32; 4];
                h[next] = 1.0;
                ex.on_hidden(layer, &h, 1);
                ex.with_experts(layer, &[e as u32], &mut |_, b| {
                    assert_eq!(b.data.len(), 3 * bytes);
                    for (i, &v) in b.data.iter().enumerate() {
                        assert_eq!(v, SlowStore::byte(layer, e, i), "L{layer} E{e} byte {i} (can_block {can_block}, direct {direct})");
                    }
                    handed += 1;
                })
                .unwrap();
            }
        }
        assert_eq!(handed, 120);
        let s = ex.stats();
        assert!(s.prefetch_loads > 0 && s.prefetch_used > 0, "{s:?}");
        assert!(s.prefetch_cancelled > 0, "refused submissions drop their prefetch: {s:?}");
        assert_eq!(s.load_failures > 0, fail_every > 0, "{s:?}");
    }
}

#[test]
fn dot8_matches_a_plain_dot_product_at_every_length() {
    for n in 0..40 {
        let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..n).map(|i| (i as f32 * 1.3).cos()).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot8(&a, &b) as f64 - want).abs() < 1e-5, "n = {n}");
    }
}

#[test]
fn belady_textbook_example() {
    // Reference string 7 0 1 2 0 3 0 4 2 3 0 3 2 with 3 frames: 7 faults (OPT).
    let s: Vec<(u32, u32)> = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2].iter().map(|&e| (0, e)).collect();
    assert_eq!(belady_misses(&s, 3), 7);
    assert_eq!(belady_misses(&s, 100), 6);
}

/// Decode `tokens` one-token forwards through the two layers of a [`unit_router_store`]:
/// token t routes layer 0 to `route(t).0` and layer 1 to `route(t).1`, layer 0's FFN input
/// points at `route(t).2` (what the predictor will guess for layer 1), and `compute_ms`
/// passes between the layers.
fn decode(ex: &StreamingExperts, tokens: std::ops::Range<usize>, route: impl Fn(usize) -> (u32, u32, usize), compute_ms: u64) {
    for t in tokens {
        let (e0, e1, guess) = route(t);
        let mut h = [0.0f32; 4];
        h[guess] = 1.0;
        ex.on_hidden(0, &h, 1);
        ex.with_experts(0, &[e0], &mut |_, _| {}).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(compute_ms));
        ex.on_hidden(1, &[1.0, 0.0, 0.0, 0.0], 1);
        ex.with_experts(1, &[e1], &mut |_, _| {}).unwrap();
    }
}

/// Prefetches that only evict what the next token needs make tokens slower: after the
/// warm-up (16 tokens of each, alternating) the governor turns prefetching off, and no prefetch is
/// read while it stays off.
#[test]
fn governor_turns_off_prefetches_that_cost() {
    // Two slots; every token routes (0, 0) then (1, 1); layer 0's input predicts (1, 2),
    // which can only be loaded by evicting (1, 1). Off: both stay resident, no reads.
    let (store, router, n_expert) = unit_router_store(4 << 10, 2, 3);
    let cfg = StreamConfig { slots: 2, prefetch: true, depth: 1, temporal: false, io_threads: 2, refine: false, policy: Policy::Lru, ..Default::default() };
    let ex = StreamingExperts::new(store, vec![router; 2], n_expert, 1, cfg);
    assert!(ex.prefetching());
    decode(&ex, 0..33, |_| (0, 1, 2), 0);
    assert!(!ex.prefetching(), "{:?}", ex.stats().governor);
    let s = ex.stats();
    let g = s.governor.clone().unwrap();
    assert!(g.last_on_ms.unwrap() > g.last_off_ms.unwrap(), "{g:?}");
    assert_eq!((s.prefetch_on_tokens, s.prefetch_off_tokens), (16, 16));
    // The next 32 tokens run without prefetching: nothing is read.
    decode(&ex, 33..56, |_| (0, 1, 2), 0);
    let s2 = ex.stats();
    assert_eq!((s2.prefetch_loads, s2.bytes_read), (s.prefetch_loads, s.bytes_read), "{s2:?}");
    // With prefetching, the evicted (1, 1) was read again on demand.
    assert!(s.demand_loads > 2, "{s:?}");
}

/// Prefetches that hide reads behind compute make tokens faster: the governor keeps them.
#[test]
fn governor_keeps_prefetches_that_pay() {
    // Two slots; token t routes (0, t mod 4) then (1, t+1 mod 4), and layer 0's input
    // predicts layer 1 right: with prefetching, layer 1's read (3 × 3 ms) runs during the
    // 12 ms of compute between the layers; without, it stalls.
    let (store, router, n_expert) = unit_router_store(4 << 10, 2, 3);
    let cfg = StreamConfig { slots: 2, prefetch: true, depth: 1, temporal: false, io_threads: 2, refine: false, policy: Policy::Lru, ..Default::default() };
    let ex = StreamingExperts::new(store, vec![router; 2], n_expert, 1, cfg);
    let route = |t: usize| ((t % 4) as u32, ((t + 1) % 4) as u32, (t + 1) % 4);
    decode(&ex, 0..33, route, 12);
    let s = ex.stats();
    let g = s.governor.clone().unwrap();
    assert!(ex.prefetching(), "{g:?}");
    assert!(g.last_on_ms.unwrap() < g.last_off_ms.unwrap(), "{g:?}");
    decode(&ex, 33..56, route, 12);
    assert!(ex.stats().prefetch_loads > s.prefetch_loads);
    assert!(ex.prefetching());
}
