// llama_ref: greedy reference continuations and logits from llama.cpp, for LES's conformance tests.
//
// Build and run through tools/make_refs.sh (it holds the compile command and the llama.cpp stamp).
//
//   llama_ref MODEL PROMPTS OUT_JSON OUT_LOGITS [--n-gen 32] [--threads 2] [--ctx 512] [--top 32]
//             [--version STR] [--command STR]
//
// For every line of PROMPTS (one prompt a line, "\n" not allowed inside a prompt):
//   * tokenize like llama-completion does (add_special=true, parse_special=true);
//   * decode the whole prompt in one batch, then greedily generate n_gen tokens one at a time
//     (argmax of the logits, lowest id on ties; EOS does NOT stop generation, so positions align;
//     the first EOS/EOG position is recorded);
//   * record, for each of the n_gen+1 logit rows (row 0 = last prompt position, row i = after
//     feeding generated token i-1), the argmax, the top-1/top-2 margin and the top-K (id, logit);
//   * append the full row-0 logits (n_vocab little-endian f32) to OUT_LOGITS.
// Debugging aid (not used for the committed refs): `--dump DIR --dump-prompt I --dump-steps S`
// writes every f32 graph tensor of the first S decode calls of prompt I as raw little-endian f32
// to DIR/<step>/<name>#<k>.f32 (k counts tensors of the same name within a step), with the shape
// in DIR/<step>/index.txt; compare with LES's `LES_DEBUG_DUMP_DIR` files via tools/cmp_dumps.py.
// A fresh context is created for each prompt (empty KV cache, position 0).

#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include "ref_json.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <numeric>
#include <string>
#include <vector>

static void die(const char * msg) {
    fprintf(stderr, "llama_ref: %s\n", msg);
    exit(1);
}

struct Row {
    llama_token argmax;
    float margin;
    std::vector<std::pair<llama_token, float>> top;
    int n_nonfinite;
};

static Row analyse(const float * logits, int n_vocab, int k) {
    Row r;
    std::vector<int> idx(n_vocab);
    std::iota(idx.begin(), idx.end(), 0);
    r.n_nonfinite = 0;
    for (int i = 0; i < n_vocab; i++) if (!std::isfinite(logits[i])) r.n_nonfinite++;
    k = std::min(k, n_vocab);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
        if (logits[a] != logits[b]) return logits[a] > logits[b];
        return a < b;
    });
    for (int i = 0; i < k; i++) r.top.push_back({idx[i], logits[idx[i]]});
    r.argmax = idx[0];
    r.margin = k > 1 ? logits[idx[0]] - logits[idx[1]] : INFINITY;
    return r;
}

struct Dumper {
    std::string dir;
    int step = 0;
    std::map<std::string, int> seen;
    FILE * index = nullptr;
};

static void dumper_step(Dumper & d, int step) {
    d.step = step;
    d.seen.clear();
    if (d.index) fclose(d.index);
    std::string sd = d.dir + "/" + std::to_string(step);
    std::string cmd = "mkdir -p '" + sd + "'";
    if (system(cmd.c_str()) != 0) die("mkdir failed");
    d.index = fopen((sd + "/index.txt").c_str(), "w");
}

static bool dump_cb(struct ggml_tensor * t, bool ask, void * ud) {
    Dumper * d = (Dumper *) ud;
    if (ask) return t->type == GGML_TYPE_F32;
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) return true;
    std::string name = t->name;
    for (auto & c : name) if (c == '/' || c == ' ') c = '_';
    int k = d->seen[name]++;
    std::string fn = name + "#" + std::to_string(k) + ".f32";
    std::vector<float> buf(ggml_nelements(t));
    ggml_backend_tensor_get(t, buf.data(), 0, buf.size() * sizeof(float));
    FILE * f = fopen((d->dir + "/" + std::to_string(d->step) + "/" + fn).c_str(), "wb");
    if (!f) die("cannot write dump");
    fwrite(buf.data(), sizeof(float), buf.size(), f);
    fclose(f);
    fprintf(d->index, "%s %s %lld %lld %lld %lld", fn.c_str(), ggml_op_desc(t), (long long) t->ne[0], (long long) t->ne[1],
            (long long) t->ne[2], (long long) t->ne[3]);
    for (int i = 0; i < GGML_MAX_SRC && t->src[i]; i++) {
        const ggml_tensor * s = t->src[i];
        fprintf(d->index, " src%d=%s:%s:%s", i, s->name, ggml_type_name(s->type), s->buffer ? ggml_backend_buffer_name(s->buffer) : "-");
    }
    fprintf(d->index, "\n");
    return true;
}

int main(int argc, char ** argv) {
    if (argc < 5) die("usage: llama_ref MODEL PROMPTS OUT_JSON OUT_LOGITS [--n-gen N] [--threads T] [--ctx C] [--top K] [--version S] [--command S]");
    std::string model_path = argv[1], prompts_path = argv[2], out_json = argv[3], out_logits = argv[4];
    int n_gen = 32, n_threads = 2, n_ctx = 512, top_k = 32;
    std::string version = "unknown", command;
    bool seq_prompt = false;
    std::string dump_dir;
    int dump_prompt = 0, dump_steps = 4;  // decode the prompt one token at a time (every matmul on ggml's vec_dot path)
    for (int i = 5; i < argc; i++) {
        std::string a = argv[i];
        if (i + 1 >= argc) die("missing value");
        if (a == "--n-gen") n_gen = atoi(argv[++i]);
        else if (a == "--threads") n_threads = atoi(argv[++i]);
        else if (a == "--ctx") n_ctx = atoi(argv[++i]);
        else if (a == "--top") top_k = atoi(argv[++i]);
        else if (a == "--version") version = argv[++i];
        else if (a == "--seq-prompt") seq_prompt = atoi(argv[++i]) != 0;
        else if (a == "--command") command = argv[++i];
        else if (a == "--dump") dump_dir = argv[++i];
        else if (a == "--dump-prompt") dump_prompt = atoi(argv[++i]);
        else if (a == "--dump-steps") dump_steps = atoi(argv[++i]);
        else die(("unknown option " + a).c_str());
    }

    std::vector<std::string> prompts;
    {
        std::ifstream f(prompts_path);
        if (!f) die("cannot read prompts");
        std::string line;
        while (std::getline(f, line)) {
            if (!line.empty() && line.back() == '\r') line.pop_back();
            if (!line.empty()) prompts.push_back(line);
        }
    }

    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
    }, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) die("cannot load model");
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    char desc[256];
    llama_model_desc(model, desc, sizeof desc);
    char arch[128] = "";
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof arch);

    FILE * fl = fopen(out_logits.c_str(), "wb");
    if (!fl) die("cannot write logits file");

    std::string js;
    char tbuf[64];
    time_t now = time(nullptr);
    strftime(tbuf, sizeof tbuf, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    std::string model_base = model_path.substr(model_path.find_last_of('/') + 1);
    std::string logits_base = out_logits.substr(out_logits.find_last_of('/') + 1);

    js += "{\n";
    js += "\"format\": \"les-llama-ref-1\",\n";
    js += "\"llama_cpp\": " + json_str(version) + ",\n";
    js += "\"system_info\": " + json_str(llama_print_system_info()) + ",\n";
    js += "\"command\": " + json_str(command) + ",\n";
    js += "\"date\": \"" + std::string(tbuf) + "\",\n";
    js += "\"model\": " + json_str(model_base) + ",\n";
    js += "\"model_desc\": " + json_str(desc) + ",\n";
    js += "\"architecture\": " + json_str(arch) + ",\n";
    js += "\"n_vocab\": " + std::to_string(n_vocab) + ",\n";
    js += "\"params\": {\"n_ctx\": " + std::to_string(n_ctx) + ", \"n_threads\": " + std::to_string(n_threads) +
          ", \"n_gen\": " + std::to_string(n_gen) + ", \"top_k\": " + std::to_string(top_k) +
          ", \"add_special\": true, \"parse_special\": true, \"sampling\": \"greedy argmax, lowest id on ties, no stop at EOS\"" +
          ", \"prompt_decode\": \"one batch\", \"gen_decode\": \"one token per llama_decode\", \"flash_attn\": \"llama.cpp default\"},\n";
    js += "\"logits_file\": " + json_str(logits_base) + ",\n";
    js += "\"logits_layout\": \"for each prompt in order: n_vocab little-endian f32 logits of the last prompt position (the row that chose generated[0])\",\n";
    js += "\"rows\": \"rows[i] = logits that chose generated[i] (i < n_gen); rows[n_gen] = logits after feeding generated[n_gen-1]\",\n";
    js += "\"prompts\": [\n";

    Dumper dumper;
    dumper.dir = dump_dir;
    for (size_t pi = 0; pi < prompts.size(); pi++) {
        const bool dumping = !dump_dir.empty() && (int) pi == dump_prompt;
        if (!dump_dir.empty() && !dumping) continue;
        const std::string & p = prompts[pi];
        int n = -llama_tokenize(vocab, p.c_str(), (int) p.size(), nullptr, 0, true, true);
        std::vector<llama_token> toks(n);
        if (llama_tokenize(vocab, p.c_str(), (int) p.size(), toks.data(), n, true, true) != n) die("tokenize failed");
        if (n + n_gen + 1 > n_ctx) die("context too small");

        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = n_ctx;
        cp.n_batch = std::max(n_ctx, 512);
        cp.n_threads = n_threads;
        cp.n_threads_batch = n_threads;
        if (dumping) {
            cp.cb_eval = dump_cb;
            cp.cb_eval_user_data = &dumper;
        }
        llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) die("cannot create context");

        std::vector<Row> rows;
        std::vector<llama_token> gen;
        int first_eog = -1;
        std::string text;

        std::vector<llama_token> cur = toks;
        if (seq_prompt && cur.size() > 1) {
            for (size_t i = 0; i + 1 < cur.size(); i++) {
                llama_batch b1 = llama_batch_get_one(&cur[i], 1);
                if (llama_decode(ctx, b1) != 0) die("decode failed");
            }
            cur.erase(cur.begin(), cur.end() - 1);
        }
        for (int step = 0; step <= n_gen; step++) {
            if (dumping) {
                if (step >= dump_steps) break;
                dumper_step(dumper, step);
            }
            llama_batch b = llama_batch_get_one(cur.data(), (int) cur.size());
            if (llama_decode(ctx, b) != 0) die("decode failed");
            const float * lg = llama_get_logits_ith(ctx, -1);
            if (step == 0) fwrite(lg, sizeof(float), n_vocab, fl);  // x86/ARM: native order is little-endian
            rows.push_back(analyse(lg, n_vocab, top_k));
            if (step == n_gen) break;
            llama_token t = rows.back().argmax;
            gen.push_back(t);
            if (first_eog < 0 && llama_vocab_is_eog(vocab, t)) first_eog = step;
            text += piece(vocab, t);
            cur.assign(1, t);
        }
        llama_free(ctx);
        if (dumping) {
            if (dumper.index) fclose(dumper.index);
            dumper.index = nullptr;
            fprintf(stderr, "dumped %d steps of prompt %zu to %s\n", dumper.step + 1, pi, dump_dir.c_str());
            continue;
        }

        js += "{\"index\": " + std::to_string(pi) + ", \"prompt\": " + json_str(p) + ",\n";
        js += " \"prompt_tokens\": [";
        for (int i = 0; i < n; i++) js += (i ? "," : "") + std::to_string(toks[i]);
        js += "],\n \"generated\": [";
        for (int i = 0; i < n_gen; i++) js += (i ? "," : "") + std::to_string(gen[i]);
        js += "],\n \"first_eog\": " + std::to_string(first_eog) + ",\n";
        js += " \"text\": " + json_str(text) + ", \"text_utf8_valid\": " + (is_valid_utf8(text) ? "true" : "false") +
              ", \"text_hex\": \"" + hex(text) + "\",\n";
        js += " \"rows\": [\n";
        for (size_t r = 0; r < rows.size(); r++) {
            js += "  {\"argmax\": " + std::to_string(rows[r].argmax) + ", \"margin\": " + fmt_f32(rows[r].margin);
            if (rows[r].n_nonfinite) js += ", \"n_nonfinite\": " + std::to_string(rows[r].n_nonfinite);
            js += ", \"top\": [";
            for (size_t k = 0; k < rows[r].top.size(); k++)
                js += std::string(k ? "," : "") + "[" + std::to_string(rows[r].top[k].first) + "," + fmt_f32(rows[r].top[k].second) + "]";
            js += "]}" + std::string(r + 1 < rows.size() ? "," : "") + "\n";
        }
        js += " ]}" + std::string(pi + 1 < prompts.size() ? "," : "") + "\n";
        fprintf(stderr, "[%zu] %s|%s\n", pi, p.c_str(), text.c_str());
    }
    js += "]\n}\n";
    fclose(fl);

    FILE * fj = fopen(out_json.c_str(), "wb");
    if (!fj) die("cannot write json");
    fwrite(js.data(), 1, js.size(), fj);
    fclose(fj);

    llama_model_free(model);
    llama_backend_free();
    return 0;
}
