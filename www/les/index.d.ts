// Types of the LES browser API (les-engine).

/** A streamed model's memory budget (bytes). */
export interface MemoryBudget {
  budget: number;
  /** The least budget the model runs in (dense weights + KV cache + scratch + top-k + 1 slots). */
  minimum: number;
  expert_slots: number;
  /** Bytes the expert cache's buffers hold now. */
  expert_bytes_held: number;
  /** Dense bytes read from storage at each use (0 in the browser: dense weights stay held). */
  dense_streamed: number;
  /** The allocator's emergency reserve (1/32 of the budget, 1-16 MiB): an allocation the wasm
   * heap refuses frees it and goes on, and the engine then lowers its budget by an eighth and
   * takes a new one. `reserve_releases` counts such refusals. */
  reserve_bytes: number;
  reserve_releases: number;
}

/** `engine.plan()`'s forecast (bytes, tokens/s), as `les plan --json`. */
export interface Forecast {
  fits: boolean;
  /** Why it does not fit (names the minimum). */
  why: string | null;
  plan: { budget: number; dense: number; kv: number; scratch: number; slots: number; expert_bytes_max: number; minimum: number } | null;
  minimum: number;
  largest_context: number;
  hit_rate: number;
  decode_hit_rate: number;
  hit_rate_source: string;
  reads_per_token: number;
  bytes_per_token: number;
  read_ms_per_token: number;
  decode_tokens_per_s: number | null;
  decode_tokens_per_s_overlapped: number | null;
  decode_bound: 'compute' | 'reads' | null;
  prompt_tokens: number;
  prompt_tokens_per_s: number | null;
  prompt_bound: 'compute' | 'reads' | null;
}

/** Progress of downloading / loading a model. Sizes in bytes. */
export interface Progress {
  /** 'mmproj': the vision tower being stored (a URL) before it is read into the engine. */
  phase: 'download' | 'load' | 'mmproj' | 'error';
  loaded?: number;
  total?: number;
  /** Every block of the model is stored (verified) in browser storage. */
  complete?: boolean;
  /** Where the model is stored: 'opfs' or 'indexeddb'. */
  backing?: 'opfs' | 'indexeddb';
  /** Set when phase is 'error' (the background download stopped; reload to resume). */
  error?: { name: string; message: string };
}

export interface CreateEngineOptions {
  /** URL of a GGUF or `.les` bundle (HTTP Range requests required), a File, or a FileSystemFileHandle. */
  model: string | File | Blob | FileSystemFileHandle;
  /**
   * A vision tower (an mmproj GGUF: `minicpmv4_6`, MiniCPM-V 4.6-style) for the model: a URL
   * (stored in browser storage like the model), a File or a FileSystemFileHandle. Its weights
   * are read into memory, on top of `memoryBudgetMB`. Chat messages may then hold images
   * (`ImageContentPart`); `info.vision` describes it.
   */
  mmproj?: string | File | Blob | FileSystemFileHandle;
  /** Memory budget in MiB for dense weights, expert cache, KV cache and scratch; 0 keeps every expert resident. */
  memoryBudgetMB?: number;
  /** 'auto' uses WebGPU when an adapter exists, else the CPU (wasm SIMD128). Default 'auto'. */
  backend?: 'auto' | 'webgpu' | 'cpu';
  /** Context size in tokens (default 2048). */
  nCtx?: number;
  /** Browser storage for URL models: 'auto' (OPFS, else IndexedDB), 'opfs' or 'indexeddb'. */
  backing?: 'auto' | 'opfs' | 'indexeddb';
  /** Expert slots on the GPU (default: the budget's GPU pool; see README "Memory"). */
  gpuExpertSlots?: number;
  /**
   * Lookahead prefetching (default true): experts predicted for the coming layers are read
   * asynchronously while the engine computes. With a cross-origin-isolated page (COOP/COEP) an I/O
   * worker reads them into shared memory; without it they land whenever the engine awaits (every
   * layer on WebGPU, between tokens on the CPU).
   */
  prefetch?: boolean;
  /**
   * Prefetch on every token (default false: the engine measures, on tokens alternating with
   * prefetching on and off, whether it makes tokens faster, and turns it off while it does not;
   * `stats().stream.governor` says what it chose).
   */
  prefetchAlways?: boolean;
  /** Asynchronous prefetch reads in flight at once (default 1, as `les run --prefetch-inflight`). */
  ioLanes?: number;
  /** Eviction policy of the expert cache (default 'next-use', as `les run --policy`). */
  policy?: 'lru' | 'lfu' | 'next-use';
  /** Lookahead depth in layers (default 1, as `les run --lookahead`). */
  lookahead?: number;
  /**
   * Benchmarks: read the stored model at the pace of a modelled flash device, the native
   * `--store` profiles ('phone-1.5GBps', 'phone-4GBps', 'laptop-nvme'; 'disk' or absent: as fast
   * as browser storage goes). Needs a cross-origin isolated page.
   */
  store?: string;
  /** Expert cache slots instead of what the budget allows (benchmarks, tests). */
  expertSlots?: number;
  /**
   * CPU path on a cross-origin isolated page: threads for the CPU kernels (the threaded build,
   * `pkg-mt/`). Default: measured at load: a pool of up to 8 web workers (at most
   * navigator.hardwareConcurrency) times matrix-vector products on 1, 2, … threads and keeps the
   * fewest within 5% of the fastest (`threads.measuredMs`). 1, or a page without isolation,
   * or the WebGPU path: the plain build, one thread. Results are the same bits either way.
   */
  threads?: number;
  /**
   * Take the relaxed-SIMD build (`pkg-relaxed/`, `pkg-mt-relaxed/`) where the browser validates
   * relaxed SIMD (default true). Its quantized dot products use `i32x4.relaxed_dot_i8x16_i7x16_add_s`
   * with operands kept in the range where the instruction is deterministic: the same bits as the
   * SIMD128 build, faster. `false` forces the SIMD128 build (`ThreadInfo.simd` says which ran).
   */
  relaxedSimd?: boolean;
  /**
   * With a memory budget on a cross-origin isolated page and the threaded build (its wasm memory is
   * shared), the I/O worker reads prefetched experts straight into their slots (default true).
   * `false`: into the worker's own buffer, copied into the slot when the engine takes it in
   * (benchmarks). `lastResult.reads.direct` counts the reads that needed no copy.
   */
  directReads?: boolean;
  /**
   * With the relaxed-SIMD build, the Q4_0, Q4_1 and Q8_0 matrices held in memory (dense weights,
   * and experts without a memory budget) are repacked at load, four rows interleaved (ggml's
   * `block_q4_0x4` idea), so the CPU kernels need no horizontal sums: the same bits, faster
   * (default true). `false`: the file's layout (comparisons). WebGPU gets the file's layout
   * either way; experts streamed under a budget keep it.
   */
  repack?: boolean;
  /**
   * Milliseconds the engine blocks on the I/O worker's read (one it needs now, or a direct read
   * into a slot it gives to another expert) before it gives the I/O worker up (default 60000):
   * the worker is terminated, its unfinished reads fail (the engine reads those experts itself)
   * and prefetching goes on without asynchronous reads (`lastResult.reads.workerStopped`).
   */
  ioTimeoutMs?: number;
  /** Tests: every n-th asynchronous prefetch read fails (the engine must not notice but in its counters). */
  debugFailReads?: number;
  /** Tests: the I/O worker stops answering at its n-th read, as a hung worker would. */
  debugStallReads?: number;
  onProgress?: (p: Progress) => void;
  /** URL of worker.js when a bundler moves it. */
  workerUrl?: string | URL;
}

export interface GenerateOptions {
  max_tokens?: number;
  /** 0 = greedy. */
  temperature?: number;
  top_k?: number;
  top_p?: number;
  min_p?: number;
  repeat_penalty?: number;
  seed?: number;
  ignore_eos?: boolean;
  /** Stop strings (generate: an array): generation ends before the first one; it is not returned. */
  stop?: string[];
  /** When the context is full, keep this many tokens and drop the older half of the rest
   *  (llama.cpp's context shift); absent: stop with finish_reason 'length'. */
  n_keep?: number;
}

/** Per-layer expert counters (cumulative for the current generation). */
export interface LayerStats {
  hits: number;
  late: number;
  misses: number;
  /** Per lookahead distance d (index d-1): predicted-and-routed, predictions made, routed. */
  pred_tp: number[];
  pred_made: number[];
  pred_routed: number[];
  stall_ms: number;
}

export interface EngineStats {
  prompt_tokens: number;
  prompt_reused: number;
  finish_reason: 'stop' | 'length' | 'abort' | null;
  prompt_ms: number;
  gen_tokens: number;
  gen_ms: number;
  tokens_per_s: number;
  /** null when every expert is resident. */
  hit_rate: number | null;
  recall_d1: number | null;
  bytes_per_token: number | null;
  stream: { tokens: number; bytes_read: number; stall_ms: number; layers: LayerStats[]; [k: string]: unknown } | null;
  backend: string;
  /** What executes expert reads: 'asynchronous reads (shared|local, N lanes)' or 'on the compute thread'; null when resident. */
  reads: string | null;
  /** FNV-1a (hex) over the bits of every logit row of this generation: equal runs, equal hashes. */
  logits_fnv: string;
  /** Threads the CPU kernels run on. */
  cpu_threads: number;
  /** Size of the wasm linear memory in bytes. */
  wasm_heap_bytes: number;
  /**
   * A prompt with images: its embedding rows, the image pieces encoded (0 when the cache held
   * them all: the same image in the same place as before), the encoding's time and the whole
   * image prefill's (ms, part of `prompt_ms`). null for a text prompt.
   */
  images: { image_rows: number; encoded: number; encode_ms: number; prefill_ms: number } | null;
  /** On WebGPU: the backend's calls (null on the CPU). `per_token` is one decode token's mean. */
  gpu: { forwards: number; decode_forwards: number; per_token: GpuRates; bind_groups_cached: number; [k: string]: unknown } | null;
}

/**
 * WebGPU calls per decode token (issue 55): `queue.submit`s, readbacks (each a `mapAsync` the
 * engine awaits), dispatches, compute passes, bind groups and buffers created, `clearBuffer`s,
 * `writeBuffer` calls and bytes.
 */
export interface GpuRates {
  submits: number;
  readbacks: number;
  dispatches: number;
  passes: number;
  bind_groups: number;
  buffers: number;
  clears: number;
  writes: number;
  write_bytes: number;
}

/** Counters of the page's asynchronous expert reads (null: none, e.g. prefetch off or all resident). */
export interface ReadStats {
  /** 'shared': an I/O worker and shared memory (cross-origin isolated page); 'local': promises in the engine's worker. */
  mode: 'shared' | 'local';
  submitted: number;
  /** Reads refused (bytes not stored yet: the store's range fetch serves them). */
  refused: number;
  completed: number;
  failed: number;
  bytes: number;
  /** Times the engine blocked on a read it needed (shared mode). */
  blocked: number;
  /** Reads that landed straight in the engine's memory (no copy; threaded build, shared mode). */
  direct: number;
  /** The I/O worker did not finish a read within `ioTimeoutMs` and was stopped (shared mode). */
  workerStopped: boolean;
}

export interface Stats {
  engine: EngineStats | null;
  storage: { verified: number; checksumFailures: number; fetchedOnDemand: number; fetchedBackground: number } | null;
  http: { requests: number; bytes: number } | null;
  reads: ReadStats | null;
  threads: ThreadInfo;
  complete: boolean | null;
}

/** CPU kernels: threads, why that many, and the build's SIMD instructions. */
export interface ThreadInfo {
  n: number;
  why: string;
  simd: 'relaxed-simd' | 'simd128' | null;
  /** The load-time measurement behind the default: ms per 1536 × 576 Q4_0 matrix-vector
   * product on 1, 2, … threads (the best of 5 interleaved rounds of 32); null when `threads` was given. */
  measuredMs: number[] | null;
  /** Whether `f32x4.relaxed_madd` is a fused multiply-add here (then the relaxed build's f32
   * lanes use it; the bits are the same either way). */
  fusedMadd: boolean;
}

export interface GenerateResult {
  text: string;
  tokens: number[];
  promptTokens: number;
  /** Prompt tokens reused from the previous generation's cache (not run again). */
  promptReused: number;
  finishReason: 'stop' | 'length' | 'abort';
  aborted: boolean;
  stats: EngineStats;
  reads: ReadStats | null;
  threads: ThreadInfo;
}

export interface ModelInfo {
  arch: string | null;
  name: string | null;
  n_layer: number;
  /** Layers with routed experts (n_layer less the leading dense layers; 0 for a dense model). */
  n_moe_layer: number;
  n_embd: number;
  n_expert: number;
  n_expert_used: number;
  n_vocab: number;
  n_ctx: number;
  model_bytes: number;
  /** `slots` expert slots in all; of them `gpu_slots` on the GPU (WebGPU: the rest is a CPU staging cache). */
  plan: { budget: number; dense: number; kv: number; scratch: number; expert_bytes_max: number; slots: number; gpu_slots: number; minimum: number; total_expert_bytes: number } | null;
  backend: string;
  has_chat_template: boolean;
  /** The vision tower loaded with `mmproj` (null: none, the chat takes text only). */
  vision: { projector: string; n_embd_out: number; image_size: number; bytes: number } | null;
}

/**
 * An image for a chat message. Sent to the engine as PNG or JPEG file bytes, decoded by LES (as
 * llama.cpp decodes them):
 * - a `data:` URL, base64 (`data:image/png;base64,…`), or a `blob:` URL (URL.createObjectURL);
 *   remote URLs (http, https) are refused: the engine fetches nothing (pass the fetched Blob);
 * - a Blob or File, an ArrayBuffer or typed array holding the file's bytes;
 * - an ImageBitmap, <img>, <canvas>, OffscreenCanvas or VideoFrame: drawn to an OffscreenCanvas
 *   and encoded as PNG; an ImageData (RGBA pixels) is put there the same way (alpha is dropped,
 *   as for any image: a canvas keeps colours premultiplied, so translucent pixels lose precision).
 * Files in a format the browser decodes but LES does not (WebP, GIF, AVIF, BMP) are drawn to PNG
 * by the browser first; PNG and JPEG go as they are.
 */
export type ImageSource = string | Blob | ArrayBuffer | ArrayBufferView | ImageBitmap | ImageData | HTMLImageElement | HTMLCanvasElement | OffscreenCanvas | VideoFrame;

export interface TextContentPart {
  type: 'text';
  text: string;
}

/** OpenAI's image part; `url` may also be the image itself (a Blob, an ImageBitmap, …). */
export interface ImageContentPart {
  type: 'image_url';
  image_url: { url: ImageSource; detail?: 'auto' | 'low' | 'high' } | ImageSource;
}

export interface ChatMessage {
  role: 'system' | 'user' | 'assistant';
  /**
   * A string, or content parts: text parts are joined with newlines (none next to an image);
   * images need a vision tower (`mmproj`) and go where their part is.
   */
  content: string | (TextContentPart | ImageContentPart)[];
}

export interface ChatCompletionRequest extends Omit<GenerateOptions, 'stop'> {
  messages: ChatMessage[];
  stream?: boolean;
  max_completion_tokens?: number;
  stop?: string | string[];
}

/** `prompt_tokens_details.cached_tokens`: prompt tokens reused from the engine's cache. */
export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  prompt_tokens_details: { cached_tokens: number };
}

export interface ChatCompletion {
  id: string;
  object: 'chat.completion';
  created: number;
  model: string;
  /** gpt-oss (harmony): `content` is the final channel, `reasoning_content` the analysis channel. */
  choices: { index: number; message: { role: 'assistant'; content: string; reasoning_content?: string }; finish_reason: 'stop' | 'length' | 'abort' }[];
  usage?: Usage;
}

export interface ChatCompletionChunk {
  id: string;
  object: 'chat.completion.chunk';
  created: number;
  model: string;
  choices: { index: number; delta: { content?: string; reasoning_content?: string }; finish_reason: 'stop' | 'length' | 'abort' | null }[];
  usage?: Usage;
}

export declare class Engine {
  readonly info: ModelInfo;
  /** The backend in use, e.g. 'cpu (wasm)' or 'webgpu (...)'. */
  readonly backend: string;
  /** Text chunks as they are generated. */
  generate(prompt: string, options?: GenerateOptions): AsyncGenerator<string, void, void>;
  /** Tokens, text and stats of the last finished generation. */
  readonly lastResult: GenerateResult | null;
  /**
   * OpenAI-style chat. With a vision tower, messages may hold images (`ImageContentPart`). A
   * request the engine refuses (an image that does not decode, images without a vision tower,
   * a remote image URL) rejects the returned promise, streaming or not; the error's message
   * says what was wrong (e.g. 'the image could not be decoded: …').
   */
  chat: {
    completions: {
      create(req: ChatCompletionRequest & { stream: true }): Promise<AsyncIterable<ChatCompletionChunk>>;
      create(req: ChatCompletionRequest & { stream?: false }): Promise<ChatCompletion>;
    };
  };
  /** Forget the cached conversation (chat calls reuse the longest prefix the engine holds). */
  resetChat(): Promise<boolean>;
  /**
   * Will it fit, and how fast? `les plan`'s forecast for this model (defaults: the budget and
   * context now, this page's storage probed, a 512-token first prompt). The hit rate replays the
   * routing seen so far; compute comes from the last generation (none before the first: the
   * speeds are then null).
   */
  plan(options?: { memoryBudgetMB?: number; nCtx?: number; store?: 'phone-1.5GBps' | 'phone-4GBps' | 'laptop-nvme'; promptTokens?: number }): Promise<Forecast>;
  /** The memory budget in bytes; `null` for a model held whole (no `memoryBudgetMB`). */
  memoryBudget(): Promise<MemoryBudget | null>;
  /**
   * Change the memory budget to `mb` MiB (`'minimum'`: the model's minimum), also while a
   * generation runs: the expert cache shrinks or grows, the conversation and output do not
   * change. Rejects below the minimum (nothing changes). The wasm heap never shrinks: memory the
   * cache gives back is reused inside it.
   */
  setMemoryBudget(mb: number | 'minimum'): Promise<MemoryBudget>;
  /**
   * While the page is hidden or frozen, keep the budget at the model's minimum; restore it when
   * the page is shown again (`on = false` stops). Frees what lives outside the wasm heap (a
   * WebGPU expert pool); inside the heap the memory is reused (the heap never shrinks).
   */
  shrinkWhenHidden(on?: boolean): void;
  /** Stop the running generation after the current token. */
  abort(): Promise<boolean>;
  stats(): Promise<Stats>;
  /** Resolves when the background download has finished (or stopped). */
  waitForDownload(): Promise<{ complete: boolean }>;
  /** Free the model and terminate the worker. */
  unload(): Promise<void>;
}

/**
 * Errors keep their `name`: 'QuotaExceededError' (browser storage full; nothing half-written is
 * kept), 'ChecksumError' (a block failed its CRC-32 three times), 'RangeNotSupported',
 * 'NetworkError', 'NotFound', 'EngineCrashed' (the engine's wasm trapped, e.g. a panic in a kernel:
 * that call and every later one fail; unload it and create a new engine), or 'LesError' (a model or
 * engine error, e.g. a budget below the model's minimum, with the minimum in the message).
 */
export declare function createEngine(options: CreateEngineOptions): Promise<Engine>;

/** Models stored in this origin's OPFS. */
export declare function listModels(workerUrl?: string | URL): Promise<{ key: string; url?: string; size?: number; storedBytes: number; backing: 'opfs' }[]>;
/** Delete a stored model (by its URL) from OPFS and IndexedDB. */
export declare function deleteModel(url: string, workerUrl?: string | URL): Promise<void>;
/** This origin's storage usage and quota, in bytes. */
export declare function storageUsage(workerUrl?: string | URL): Promise<{ usage: number; quota: number }>;
