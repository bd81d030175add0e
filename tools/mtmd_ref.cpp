// mtmd_ref: llama.cpp (libmtmd) references for LES's vision-language tests (MiniCPM-V 4.6-style
// minicpmv4_6 mmproj + qwen35 / qwen35moe text tower).
//
// Build and run through tools/make_vision_refs.sh (it holds the compile command, the llama.cpp stamp
// and the merge of the per-model outputs into tests/data/vision/refs.json).
//
//   mtmd_ref --model TEXT.gguf --mmproj MMPROJ.gguf --cases CASES.tsv --json OUT.json --bin OUT.bin
//            --dump DIR [--threads 2] [--n-gen 16] [--ctx 4096] [--top 8]
//
// CASES.tsv: one case a line, "name<TAB>formatted prompt<TAB>image,image,...", the prompt with "\n"
// escaped as the two characters \n and the media marker <__media__> once per image (the chat
// template already applied: make_vision_refs.sh checks it against llama-mtmd-cli -v).
// For each case, as llama-mtmd-cli does it:
//   * load every image with mtmd_helper_bitmap_init_from_file (stb_image); a failure is recorded and
//     ends the case (bad-input tests). The decoded RGB bytes go to DIR/<case>.<k>.rgb;
//   * split the prompt on the marker and tokenize with mtmd_tokenize_from_parts (text parts
//     add_special=false, parse_special=true; add_special=true for the whole, as mtmd-cli's first turn);
//   * for every chunk: text tokens (+ pieces), or image n_tokens / nx / ny / n_pos and the decoder
//     positions (t, x, y, z) mtmd_image_tokens_get_decoder_pos gives at the running n_past;
//   * encode every image chunk with mtmd_encode_chunk; all output embeddings (n_tokens x n_embd f32)
//     are appended to OUT.bin; a second mtmd context with an eval callback records statistics of
//     the clip graph's input (inp_raw, planar [nx, ny, 3], written whole to DIR/<case>.c<i>.inp_raw.f32)
//     and of named intermediate tensors, and its output is compared with the first's; a third context
//     encodes with flash attention disabled (f32 K/V instead of f16) and its embeddings are appended too;
//   * a fresh llama context (n_ctx, n_batch 2048, n_ubatch 512, flash attention auto: mtmd-cli's
//     defaults) evaluates the chunks with mtmd_helper_eval_chunks (n_batch 2048, logits of the last
//     token), then greedy decoding (argmax, lowest id on ties) of up to n_gen tokens, stopping at an
//     EOG token as mtmd-cli does (the EOG token is recorded, not printed). The first row's logits
//     (n_vocab f32) are appended to OUT.bin.

#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include "mtmd.h"
#include "mtmd-helper.h"
#include "ref_json.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

static void die(const std::string & msg) {
    fprintf(stderr, "mtmd_ref: %s\n", msg.c_str());
    exit(1);
}

static std::string fmt_f64(double v) {
    char b[40];
    snprintf(b, sizeof b, "%.17g", v);
    return b;
}

static std::string f32_list(const float * v, size_t n) {
    std::string o = "[";
    for (size_t i = 0; i < n; i++) o += (i ? "," : "") + fmt_f32(v[i]);
    return o + "]";
}

// sum, sum of squares (double, in memory order), min, max, first n values
static std::string stats_json(const float * v, size_t n, size_t n_first) {
    double s = 0, s2 = 0;
    float mn = INFINITY, mx = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        s += v[i];
        s2 += (double) v[i] * v[i];
        mn = std::min(mn, v[i]);
        mx = std::max(mx, v[i]);
    }
    return "\"count\": " + std::to_string(n) + ", \"sum\": " + fmt_f64(s) + ", \"sumsq\": " + fmt_f64(s2) +
           ", \"min\": " + fmt_f32(mn) + ", \"max\": " + fmt_f32(mx) +
           ", \"first\": " + f32_list(v, std::min(n, n_first));
}

// ---- eval callback of the debug mtmd context: statistics of named clip graph tensors ----

static const std::set<std::string> DEBUG_NAMES = {
    "patch_bias", "pos_embed", "layer_out-0", "layer_out-1", "vit_merger_attn_inp_normed",
    "vit_merger_attn_residual", "vit_merger_ds_mean_res", "vit_merger_ds_normed", "vit_merger_ds_mlp_out",
    "vit_merger_ds_out", "layer_out-2", "layer_out-3", "post_ln", "merger_normed", "merger_out",
};

struct DebugCapture {
    std::vector<std::pair<std::string, std::string>> records;  // name -> json object body
    std::vector<float> inp_raw;
    int64_t inp_ne[4] = {0, 0, 0, 0};
    void clear() { records.clear(); inp_raw.clear(); }
};

static std::vector<float> tensor_f32(const ggml_tensor * t) {
    std::vector<float> buf(ggml_nelements(t));
    ggml_backend_tensor_get(t, buf.data(), 0, buf.size() * sizeof(float));
    return buf;
}

static bool debug_cb(struct ggml_tensor * t, bool ask, void * ud) {
    DebugCapture * d = (DebugCapture *) ud;
    const bool named = DEBUG_NAMES.count(t->name) > 0;
    const bool im2col = t->op == GGML_OP_IM2COL && t->src[1] && strcmp(t->src[1]->name, "inp_raw") == 0;
    if (ask) return (named && t->type == GGML_TYPE_F32) || im2col;
    if (im2col && d->inp_raw.empty()) {
        const ggml_tensor * s = t->src[1];
        d->inp_raw = tensor_f32(s);
        for (int i = 0; i < 4; i++) d->inp_ne[i] = s->ne[i];
    }
    if (named && t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
        auto v = tensor_f32(t);
        std::string body = "\"ne\": [" + std::to_string(t->ne[0]) + "," + std::to_string(t->ne[1]) + "," +
                           std::to_string(t->ne[2]) + "," + std::to_string(t->ne[3]) + "], " +
                           stats_json(v.data(), v.size(), 8);
        d->records.push_back({t->name, body});
    }
    return true;
}

struct Case {
    std::string name, prompt;
    std::vector<std::string> images;
};

static std::string unescape(const std::string & s) {
    std::string o;
    for (size_t i = 0; i < s.size(); i++) {
        if (s[i] == '\\' && i + 1 < s.size() && s[i + 1] == 'n') { o += '\n'; i++; }
        else if (s[i] == '\\' && i + 1 < s.size() && s[i + 1] == '\\') { o += '\\'; i++; }
        else o += s[i];
    }
    return o;
}

static std::vector<std::string> split(const std::string & s, char c) {
    std::vector<std::string> out;
    std::string cur;
    std::istringstream is(s);
    while (std::getline(is, cur, c)) out.push_back(cur);
    return out;
}

int main(int argc, char ** argv) {
    std::string model_path, mmproj_path, cases_path, out_json, out_bin, dump_dir;
    int n_threads = 2, n_gen = 16, n_ctx = 4096, top_k = 8;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (i + 1 >= argc) die("missing value for " + a);
        if (a == "--model") model_path = argv[++i];
        else if (a == "--mmproj") mmproj_path = argv[++i];
        else if (a == "--cases") cases_path = argv[++i];
        else if (a == "--json") out_json = argv[++i];
        else if (a == "--bin") out_bin = argv[++i];
        else if (a == "--dump") dump_dir = argv[++i];
        else if (a == "--threads") n_threads = atoi(argv[++i]);
        else if (a == "--n-gen") n_gen = atoi(argv[++i]);
        else if (a == "--ctx") n_ctx = atoi(argv[++i]);
        else if (a == "--top") top_k = atoi(argv[++i]);
        else die("unknown option " + a);
    }
    if (model_path.empty() || mmproj_path.empty() || cases_path.empty() || out_json.empty() || out_bin.empty() ||
        dump_dir.empty()) die("usage: see the header of tools/mtmd_ref.cpp");

    std::vector<Case> cases;
    {
        std::ifstream f(cases_path);
        if (!f) die("cannot read cases");
        std::string line;
        while (std::getline(f, line)) {
            if (line.empty() || line[0] == '#') continue;
            auto cols = split(line, '\t');
            if (cols.size() < 2) die("bad case line: " + line);
            Case c;
            c.name = cols[0];
            c.prompt = unescape(cols[1]);
            if (cols.size() > 2 && !cols[2].empty()) c.images = split(cols[2], ',');
            cases.push_back(c);
        }
    }

    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
    }, nullptr);
    mtmd_helper_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
    }, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) die("cannot load model");
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const int n_embd = llama_model_n_embd_inp(model);

    mtmd_context_params mparams = mtmd_context_params_default();
    mparams.use_gpu = false;
    mparams.print_timings = false;
    mparams.n_threads = n_threads;
    mtmd_context * mctx = mtmd_init_from_file(mmproj_path.c_str(), model, mparams);
    if (!mctx) die("cannot load mmproj");
    DebugCapture cap;
    mtmd_context_params dparams = mparams;
    dparams.cb_eval = debug_cb;
    dparams.cb_eval_user_data = &cap;
    mtmd_context * dctx = mtmd_init_from_file(mmproj_path.c_str(), model, dparams);
    if (!dctx) die("cannot load mmproj (debug context)");

    // third context: clip without flash attention (f32 K/V; llama-mtmd-cli's default "auto" enables flash
    // attention on the CPU, where K and V are cast to f16)
    mtmd_context_params nparams = mparams;
    nparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    mtmd_context * nctx = mtmd_init_from_file(mmproj_path.c_str(), model, nparams);
    if (!nctx) die("cannot load mmproj (no flash attention context)");

    FILE * fb = fopen(out_bin.c_str(), "wb");
    if (!fb) die("cannot write bin");
    size_t bin_off = 0;  // in f32 elements
    auto bin_put = [&](const float * v, size_t n) {
        fwrite(v, sizeof(float), n, fb);  // x86/ARM: native order is little-endian
        size_t off = bin_off;
        bin_off += n;
        return off;
    };

    std::string js = "{\n";
    js += "\"format\": \"les-mtmd-ref-1\",\n";
    js += "\"system_info\": " + json_str(llama_print_system_info()) + ",\n";
    js += "\"n_vocab\": " + std::to_string(n_vocab) + ", \"n_embd\": " + std::to_string(n_embd) + ",\n";
    js += "\"decode_use_mrope\": " + std::string(mtmd_decode_use_mrope(mctx) ? "true" : "false") + ",\n";
    js += "\"params\": {\"n_ctx\": " + std::to_string(n_ctx) + ", \"n_batch\": 2048, \"n_ubatch\": 512, \"n_threads\": " +
          std::to_string(n_threads) + ", \"n_gen\": " + std::to_string(n_gen) + ", \"top_k\": " + std::to_string(top_k) +
          ", \"flash_attn\": \"auto (text and clip)\", \"sampling\": \"greedy argmax, lowest id on ties, stop at EOG\"},\n";
    js += "\"cases\": [\n";

    const std::string marker = mtmd_default_marker();
    for (size_t ci = 0; ci < cases.size(); ci++) {
        const Case & cs = cases[ci];
        fprintf(stderr, "== %s\n", cs.name.c_str());
        js += std::string(ci ? ",\n" : "") + "{\"name\": " + json_str(cs.name) + ", \"prompt\": " + json_str(cs.prompt) +
              ",\n \"images\": [";
        // ---- load the images ----
        std::vector<mtmd_bitmap *> bitmaps;
        bool load_failed = false;
        for (size_t k = 0; k < cs.images.size(); k++) {
            const std::string & path = cs.images[k];
            auto res = mtmd_helper_bitmap_init_from_file(mctx, path.c_str(), false, mtmd_helper_init_opt_default());
            std::string base = path.substr(path.find_last_of('/') + 1);
            js += std::string(k ? ", " : "") + "{\"file\": " + json_str(base);
            if (!res.bitmap) {
                js += ", \"loaded\": false}";
                load_failed = true;
                continue;
            }
            mtmd_bitmap * bmp = res.bitmap;
            const unsigned char * data = mtmd_bitmap_get_data(bmp);
            size_t nb = mtmd_bitmap_get_n_bytes(bmp);
            uint64_t h = 1469598103934665603ull, sum = 0;
            for (size_t i = 0; i < nb; i++) { h = (h ^ data[i]) * 1099511628211ull; sum += data[i]; }
            char hb[32];
            snprintf(hb, sizeof hb, "%016llx", (unsigned long long) h);
            js += ", \"loaded\": true, \"nx\": " + std::to_string(mtmd_bitmap_get_nx(bmp)) + ", \"ny\": " +
                  std::to_string(mtmd_bitmap_get_ny(bmp)) + ", \"n_bytes\": " + std::to_string(nb) +
                  ", \"rgb_sum\": " + std::to_string(sum) + ", \"rgb_fnv1a64\": \"" + hb + "\"}";
            FILE * fr = fopen((dump_dir + "/" + cs.name + "." + std::to_string(k) + ".rgb").c_str(), "wb");
            if (fr) { fwrite(data, 1, nb, fr); fclose(fr); }
            bitmaps.push_back(bmp);
        }
        js += "]";
        if (load_failed) {
            js += ",\n \"error\": \"image load failed (mtmd_helper_bitmap_init_from_file returned no bitmap)\"}";
            for (auto * b : bitmaps) mtmd_bitmap_free(b);
            continue;
        }

        // ---- tokenize as llama-mtmd-cli's eval_message ----
        std::vector<std::string> segments;
        {
            size_t start = 0, pos;
            while ((pos = cs.prompt.find(marker, start)) != std::string::npos) {
                segments.push_back(cs.prompt.substr(start, pos - start));
                start = pos + marker.size();
            }
            segments.push_back(cs.prompt.substr(start));
        }
        if (segments.size() - 1 != bitmaps.size()) die("markers do not match images in case " + cs.name);
        std::vector<mtmd_input_text> texts(segments.size());
        std::vector<mtmd_input_part> parts;
        for (size_t i = 0; i < segments.size(); i++) {
            texts[i] = {segments[i].data(), segments[i].size(), false, true};
            parts.push_back({&texts[i], nullptr});
            if (i < bitmaps.size()) parts.push_back({nullptr, bitmaps[i]});
        }
        std::vector<const mtmd_input_part *> parts_ptr;
        for (const auto & p : parts) parts_ptr.push_back(&p);
        mtmd_input_chunks * chunks = mtmd_input_chunks_init();
        int32_t tr = mtmd_tokenize_from_parts(mctx, chunks, parts_ptr.data(), parts_ptr.size(), true);
        if (tr != 0) {
            js += ",\n \"error\": \"mtmd_tokenize_from_parts returned " + std::to_string(tr) + "\"}";
            mtmd_input_chunks_free(chunks);
            for (auto * b : bitmaps) mtmd_bitmap_free(b);
            continue;
        }

        // ---- chunks, positions, embeddings ----
        const size_t n_chunks = mtmd_input_chunks_size(chunks);
        js += ",\n \"chunks\": [\n";
        llama_pos n_past = 0;
        size_t n_tok_total = 0;
        for (size_t i = 0; i < n_chunks; i++) {
            const mtmd_input_chunk * ch = mtmd_input_chunks_get(chunks, i);
            auto type = mtmd_input_chunk_get_type(ch);
            const llama_pos n_pos = mtmd_input_chunk_get_n_pos(ch);
            const size_t n_tok = mtmd_input_chunk_get_n_tokens(ch);
            js += std::string(i ? ",\n" : "") + "  {\"index\": " + std::to_string(i) + ", \"pos_0\": " + std::to_string(n_past) +
                  ", \"n_tokens\": " + std::to_string(n_tok) + ", \"n_pos\": " + std::to_string(n_pos);
            if (type == MTMD_INPUT_CHUNK_TYPE_TEXT) {
                size_t n = 0;
                const llama_token * toks = mtmd_input_chunk_get_tokens_text(ch, &n);
                js += ", \"type\": \"text\", \"tokens\": [";
                for (size_t k = 0; k < n; k++) js += (k ? "," : "") + std::to_string(toks[k]);
                js += "], \"pieces\": [";
                for (size_t k = 0; k < n; k++) js += (k ? "," : "") + json_str(piece(vocab, toks[k]));
                js += "]}";
            } else if (type == MTMD_INPUT_CHUNK_TYPE_IMAGE) {
                const mtmd_image_tokens * it = mtmd_input_chunk_get_tokens_image(ch);
                js += ", \"type\": \"image\", \"nx\": " + std::to_string(mtmd_image_tokens_get_nx(it)) + ", \"ny\": " +
                      std::to_string(mtmd_image_tokens_get_ny(it)) + ", \"id\": " + json_str(mtmd_input_chunk_get_id(ch)) +
                      ", \"non_causal\": " + (mtmd_decode_use_non_causal(mctx, ch) ? "true" : "false");
                std::string pt, px, py, pz;
                for (size_t k = 0; k < n_tok; k++) {
                    mtmd_decoder_pos p = mtmd_image_tokens_get_decoder_pos(it, n_past, k);
                    pt += (k ? "," : "") + std::to_string(p.t);
                    px += (k ? "," : "") + std::to_string(p.x);
                    py += (k ? "," : "") + std::to_string(p.y);
                    pz += (k ? "," : "") + std::to_string(p.z);
                }
                js += ",\n   \"decoder_pos\": {\"t\": [" + pt + "], \"x\": [" + px + "], \"y\": [" + py + "], \"z\": [" + pz + "]}";
                // encode
                if (mtmd_encode_chunk(mctx, ch) != 0) die("mtmd_encode_chunk failed");
                const float * embd = mtmd_get_output_embd(mctx);
                std::vector<float> e(embd, embd + n_tok * n_embd);
                size_t off = bin_put(e.data(), e.size());
                js += ",\n   \"embd\": {\"bin_offset\": " + std::to_string(off) + ", " + stats_json(e.data(), e.size(), 16) + "}";
                // without flash attention
                if (mtmd_encode_chunk(nctx, ch) != 0) die("mtmd_encode_chunk (no FA) failed");
                {
                    const float * e3 = mtmd_get_output_embd(nctx);
                    std::vector<float> en(e3, e3 + n_tok * n_embd);
                    float md = 0;
                    for (size_t k = 0; k < e.size(); k++) md = std::max(md, std::fabs(e[k] - en[k]));
                    size_t offn = bin_put(en.data(), en.size());
                    js += ",\n   \"embd_no_flash_attn\": {\"bin_offset\": " + std::to_string(offn) + ", \"max_abs_diff_vs_embd\": " +
                          fmt_f32(md) + ", " + stats_json(en.data(), en.size(), 16) + "}";
                }
                // debug context: same chunk, with the eval callback
                cap.clear();
                if (mtmd_encode_chunk(dctx, ch) != 0) die("mtmd_encode_chunk (debug) failed");
                const float * e2 = mtmd_get_output_embd(dctx);
                float maxdiff = 0;
                for (size_t k = 0; k < e.size(); k++) maxdiff = std::max(maxdiff, std::fabs(e[k] - e2[k]));
                js += ",\n   \"debug_ctx_max_abs_diff\": " + fmt_f32(maxdiff);
                if (!cap.inp_raw.empty()) {
                    const int64_t nx = cap.inp_ne[0], ny = cap.inp_ne[1], npx = nx * ny;
                    double cs3[3] = {0, 0, 0};
                    for (int c = 0; c < 3; c++)
                        for (int64_t k = 0; k < npx; k++) cs3[c] += cap.inp_raw[c * npx + k];
                    js += ",\n   \"inp_raw\": {\"ne\": [" + std::to_string(nx) + "," + std::to_string(ny) + "," +
                          std::to_string(cap.inp_ne[2]) + "," + std::to_string(cap.inp_ne[3]) + "], \"channel_sums\": [" +
                          fmt_f64(cs3[0]) + "," + fmt_f64(cs3[1]) + "," + fmt_f64(cs3[2]) + "], " +
                          stats_json(cap.inp_raw.data(), cap.inp_raw.size(), 64) + "}";
                    FILE * fr = fopen((dump_dir + "/" + cs.name + ".c" + std::to_string(i) + ".inp_raw.f32").c_str(), "wb");
                    if (fr) { fwrite(cap.inp_raw.data(), sizeof(float), cap.inp_raw.size(), fr); fclose(fr); }
                }
                js += ",\n   \"graph\": {";
                for (size_t k = 0; k < cap.records.size(); k++)
                    js += std::string(k ? ",\n     " : "\n     ") + json_str(cap.records[k].first) + ": {" + cap.records[k].second + "}";
                js += "}}";
            } else {
                die("unexpected chunk type");
            }
            n_past += n_pos;
            n_tok_total += n_tok;
        }
        js += "\n ],\n \"n_tokens_total\": " + std::to_string(n_tok_total) + ", \"n_pos_total\": " + std::to_string(n_past) +
              ", \"helper_n_pos\": " + std::to_string(mtmd_helper_get_n_pos(chunks)) + ",\n";

        // ---- text tower: evaluate the chunks, then greedy decoding ----
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = n_ctx;
        cp.n_batch = 2048;
        cp.n_ubatch = 512;
        cp.n_threads = n_threads;
        cp.n_threads_batch = n_threads;
        llama_context * lctx = llama_init_from_model(model, cp);
        if (!lctx) die("cannot create llama context");
        llama_pos new_n_past = 0;
        if (mtmd_helper_eval_chunks(mctx, lctx, chunks, 0, 0, 2048, true, &new_n_past) != 0) die("eval_chunks failed");
        std::vector<llama_token> gen;
        std::string text, text_plain, rows;  // control tokens rendered / not (llama-completion prints them not)
        int eog_at = -1;
        for (int step = 0; step < n_gen; step++) {
            const float * lg = llama_get_logits_ith(lctx, -1);
            if (step == 0) {
                size_t off = bin_put(lg, n_vocab);
                js += " \"logits0_bin_offset\": " + std::to_string(off) + ",\n";
            }
            std::vector<int> idx(n_vocab);
            std::iota(idx.begin(), idx.end(), 0);
            int k = std::min(top_k, n_vocab);
            std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
                if (lg[a] != lg[b]) return lg[a] > lg[b];
                return a < b;
            });
            rows += std::string(step ? ",\n" : "\n") + "  {\"argmax\": " + std::to_string(idx[0]) + ", \"margin\": " +
                    fmt_f32(lg[idx[0]] - lg[idx[1]]) + ", \"top\": [";
            for (int j = 0; j < k; j++) rows += std::string(j ? "," : "") + "[" + std::to_string(idx[j]) + "," + fmt_f32(lg[idx[j]]) + "]";
            rows += "]}";
            llama_token t = idx[0];
            gen.push_back(t);
            if (llama_vocab_is_eog(vocab, t)) { eog_at = step; break; }
            text += piece(vocab, t);
            text_plain += piece(vocab, t, false);
            llama_batch b = llama_batch_get_one(&t, 1);
            if (llama_decode(lctx, b) != 0) die("decode failed");
        }
        llama_free(lctx);
        js += " \"n_past_after_prompt\": " + std::to_string(new_n_past) + ",\n \"generated\": [";
        for (size_t k = 0; k < gen.size(); k++) js += (k ? "," : "") + std::to_string(gen[k]);
        js += "], \"eog_at\": " + std::to_string(eog_at) + ",\n \"text\": " + json_str(text) + ", \"text_hex\": \"" + hex(text) +
              "\", \"text_plain_hex\": \"" + hex(text_plain) + "\",\n \"rows\": [" + rows + "\n ]}";
        fprintf(stderr, "   %s\n", text.c_str());
        mtmd_input_chunks_free(chunks);
        for (auto * b : bitmaps) mtmd_bitmap_free(b);
    }
    js += "\n]\n}\n";
    fclose(fb);
    FILE * fj = fopen(out_json.c_str(), "wb");
    if (!fj) die("cannot write json");
    fwrite(js.data(), 1, js.size(), fj);
    fclose(fj);
    mtmd_free(nctx);
    mtmd_free(dctx);
    mtmd_free(mctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
