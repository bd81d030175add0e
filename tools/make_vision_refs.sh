#!/usr/bin/env bash
# llama.cpp references for LES's vision-language tests (MiniCPM-V 4.6-style minicpmv4_6 mmproj with a
# qwen35 and a qwen35moe text tower): writes tests/data/vision/refs.json, refs.bin and preproc/*.png.
#
#   tools/make_vision_refs.sh
#
# Inputs (tools/make_vlm.py all): models/rand-minicpmv-mmproj.gguf, models/rand-qwen35-vl.gguf,
# models/rand-qwen35moe-vl.gguf and the images in tests/data/vision/.
# For each text tower: target/tools/mtmd_ref (tools/mtmd_ref.cpp against libmtmd / libllama) records
# chunk layout, positions, image embeddings, clip graph statistics and greedy output per case; then
# llama-mtmd-cli (and llama-completion for the text-only case) is run with the same prompt and its
# text must equal mtmd_ref's; its -v log gives the slice grid llama.cpp chose and the formatted
# prompt (checked against the one mtmd_ref used). Bad inputs: llama-mtmd-cli's exit status and error.
#
# Needs a llama.cpp build with llama-mtmd-cli, llama-completion and libmtmd (not needed by CI: the
# results are committed). Default: the llama.cpp vendored in the PyPI sdist llama-cpp-python==0.3.36:
#   LLAMA_CPP_DIR=/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp  (build in $LLAMA_CPP_DIR/build)
# python3 with numpy and Pillow (decoder cross-check, preproc PNGs).
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp}
BIN=$LLAMA_CPP_DIR/build/bin
THREADS=${THREADS:-2}
N_GEN=${N_GEN:-16}
D=tests/data/vision
T=target/vision
MMPROJ=models/rand-minicpmv-mmproj.gguf
mkdir -p target/tools "$T"

# ---- compile tools/mtmd_ref.cpp against mtmd.h / libmtmd (shared libs in build/bin) ----
REF=target/tools/mtmd_ref
COMPILE="g++ -O2 -std=c++17 -o $REF tools/mtmd_ref.cpp -I\$LLAMA_CPP_DIR/include -I\$LLAMA_CPP_DIR/ggml/include -I\$LLAMA_CPP_DIR/tools/mtmd -L\$LLAMA_CPP_DIR/build/bin -lmtmd -lllama -lggml -lggml-base -Wl,-rpath,\$LLAMA_CPP_DIR/build/bin"
if [ ! -x "$REF" ] || [ tools/mtmd_ref.cpp -nt "$REF" ] || [ tools/ref_json.h -nt "$REF" ]; then
  g++ -O2 -std=c++17 -o "$REF" tools/mtmd_ref.cpp \
    -I"$LLAMA_CPP_DIR/include" -I"$LLAMA_CPP_DIR/ggml/include" -I"$LLAMA_CPP_DIR/tools/mtmd" \
    -L"$BIN" -lmtmd -lllama -lggml -lggml-base -Wl,-rpath,"$BIN"
fi

ver=$("$BIN/llama-completion" --version 2>&1 | grep -m1 "^version:" || true)
built=$("$BIN/llama-completion" --version 2>&1 | grep -m1 '^built with' || true)
commit=$(git -C "$LLAMA_CPP_DIR" log -1 --format='%H %cs' 2>/dev/null || echo unknown)
VERSION="llama.cpp ${ver#version: } ${built} (vendor commit $commit), vendored in PyPI sdist llama-cpp-python==0.3.36"

# ---- cases: name, formatted prompt (ChatML, as llama-mtmd-cli formats "-p Describe"), images ----
USER_TEXT=Describe
chatml() {  # $1 = user content
  printf '<|im_start|>user\\n%s<|im_end|>\\n<|im_start|>assistant\\n' "$1"
}
M='<__media__>'
{
  printf 'text_only\t%s\t\n' "$(chatml "$USER_TEXT")"
  for img in square_224.png wide_200x150_rgba.png slice_400x240.jpg grid_336x700.png; do
    printf '%s\t%s\t%s\n' "${img%.*}" "$(chatml "$M$USER_TEXT")" "$D/$img"
  done
  printf 'two_images\t%s\t%s\n' "$(chatml "$M$M$USER_TEXT")" "$D/square_224.png,$D/slice_400x240.jpg"
  for img in bad_truncated.png bad_empty.png bad_zero_dims.png bad_garbage.jpg; do
    printf '%s\t%s\t%s\n' "${img%.*}" "$(chatml "$M$USER_TEXT")" "$D/$img"
  done
} > "$T/cases.tsv"

for arch in qwen35 qwen35moe; do
  model=models/rand-$arch-vl.gguf
  echo "== $arch: mtmd_ref" >&2
  rm -f "$T/$arch".*
  "$REF" --model "$model" --mmproj "$MMPROJ" --cases "$T/cases.tsv" --json "$T/$arch.json" --bin "$T/$arch.bin" \
    --dump "$T" --threads "$THREADS" --n-gen "$N_GEN" --ctx 4096 --top 8 2>"$T/$arch.mtmd_ref.log"
  # ---- the same cases through llama-mtmd-cli / llama-completion ----
  while IFS=$'\t' read -r name prompt images; do
    args=()
    if [ -n "$images" ]; then
      IFS=',' read -ra imgs <<<"$images"
      for i in "${imgs[@]}"; do args+=(--image "$i"); done
      cmd=("$BIN/llama-mtmd-cli" -m "$model" --mmproj "$MMPROJ" "${args[@]}" -p "$USER_TEXT" -n "$N_GEN" --temp 0 -t "$THREADS")
    else
      p=$(printf '%b.' "$prompt")  # (the "." keeps the trailing newline from $(...))
      cmd=("$BIN/llama-completion" -m "$model" -p "${p%.}" -n "$N_GEN" --temp 0 -t "$THREADS" -no-cnv --no-display-prompt)
    fi
    # text: the longest stdout of 3 plain runs (on a loaded machine the CLIs' asynchronous log thread
    # has been seen to lose the end of stdout at exit); slicing / formatted prompt from a -v run
    set +e
    : >"$T/$arch.$name.cli.out"
    : >"$T/$arch.$name.cli.err"
    for try in 1 2 3; do
      "${cmd[@]}" </dev/null >"$T/cli.try" 2>"$T/cli.try.err"
      rc=$?
      if [ "$(wc -c <"$T/cli.try")" -gt "$(wc -c <"$T/$arch.$name.cli.out")" ]; then cp "$T/cli.try" "$T/$arch.$name.cli.out"; fi
      if [ "$(wc -c <"$T/cli.try.err")" -gt "$(wc -c <"$T/$arch.$name.cli.err")" ]; then cp "$T/cli.try.err" "$T/$arch.$name.cli.err"; fi
    done
    echo $rc >"$T/$arch.$name.cli.rc"
    "${cmd[@]}" -v </dev/null >/dev/null 2>"$T/$arch.$name.cli.log"
    set -e
    printf '%q ' "${cmd[@]}" | sed "s|$BIN/||g" >"$T/$arch.$name.cli.cmd"
  done <"$T/cases.tsv"
done

python3 - "$VERSION" "$COMPILE" "$THREADS" "$N_GEN" <<'EOF'
import hashlib, json, math, os, re, sys
import numpy as np
from PIL import Image

version, compile_cmd, threads, n_gen = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
D, T = "tests/data/vision", "target/vision"
ARCHS = ["qwen35", "qwen35moe"]
MEAN, STD = 0.5, 0.5  # clip.vision.image_mean / image_std of the mmproj (all channels)
sha = lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest()  # noqa: E731
cases = [l.rstrip("\n").split("\t") for l in open(f"{T}/cases.tsv")]

def gguf_keys(path):
    import gguf
    r = gguf.GGUFReader(path)
    out = {}
    for k, f in r.fields.items():
        if k.startswith(("GGUF.", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")):
            continue
        v = f.contents()
        out[k] = v
    tensors = [{"name": t.name, "type": t.tensor_type.name, "ne": [int(x) for x in t.shape]} for t in r.tensors]
    return out, tensors

runs = {a: json.load(open(f"{T}/{a}.json")) for a in ARCHS}
bins = {a: np.fromfile(f"{T}/{a}.bin", dtype="<f4") for a in ARCHS}

# ---- merged binary: qwen35's embeddings and logits; qwen35moe's logits (its embeddings must be equal) ----
out_bin, out_len = [], 0
def put(arr):
    global out_len
    off = out_len
    out_bin.append(np.asarray(arr, dtype="<f4"))
    out_len += arr.size
    return off

def slicing_from_log(log):
    s = []
    for m in re.finditer(r"get_slice_instructions: original size: (\d+) x (\d+), overview size: (\d+) x (\d+), "
                         r"refined size: (\d+) x (\d+), grid size: (\d+) x (\d+)", log):
        a = [int(x) for x in m.groups()]
        s.append({"original": a[0:2], "overview": a[2:4], "refined": a[4:6], "grid_cols_rows": a[6:8], "slices": []})
    for m in re.finditer(r"get_slice_instructions: slice (\d+): x=(\d+), y=(\d+), size=(\d+)x(\d+)", log):
        i, x, y, w, h = (int(v) for v in m.groups())
        if s:
            s[-1]["slices"].append({"x": x, "y": y, "w": w, "h": h})
    return s

result_runs = {}
embd_map = {}  # (case, chunk index) -> offset in the merged bin
for a in ARCHS:
    rr = []
    for c in runs[a]["cases"]:
        name = c["name"]
        cli_out = open(f"{T}/{a}.{name}.cli.out", "rb").read()
        cli_log = open(f"{T}/{a}.{name}.cli.log", "r", errors="replace").read()
        cli_rc = int(open(f"{T}/{a}.{name}.cli.rc").read())
        cli_cmd = open(f"{T}/{a}.{name}.cli.cmd").read().strip()
        entry = {"name": name, "prompt": c["prompt"], "images": c["images"]}
        cli = {"command": cli_cmd, "exit_status": cli_rc}
        if "error" in c:
            entry["error"] = c["error"]
            cli_err = open(f"{T}/{a}.{name}.cli.err", "r", errors="replace").read()
            errs = [l.split(" E ", 1)[-1].strip() for l in cli_err.splitlines() if re.search(r"\d E |error|fail", l)]
            cli["error_lines"] = errs[-4:]
            entry["llama_mtmd_cli"] = cli
            rr.append(entry)
            continue
        # text printed by the CLI: mtmd-cli prints "\n" + text + "\n" (+ "\n" at exit); llama-completion text + "\n\n"
        text = bytes.fromhex(c["text_hex"] if c["images"] else c["text_plain_hex"])  # llama-completion omits control tokens
        if c["images"]:
            body = cli_out[1:] if cli_out.startswith(b"\n") else cli_out
            body = body.rstrip(b"\n")
            fmt_ok = ("formatted_chat.prompt: " + c["prompt"]) in cli_log
            cli["formatted_prompt_matches"] = fmt_ok
            assert fmt_ok, (a, name, "formatted prompt differs from llama-mtmd-cli's")
        else:
            body = cli_out
            for tr in (b" [end of text]\n\n\n", b" [end of text]\n", b"\n\n"):
                if body.endswith(tr):
                    body = body[: -len(tr)]
                    break
        cli["text"] = body.decode("utf-8", "replace")
        cli["equals_mtmd_ref_text"] = body == text
        if body != text:
            print(f"MISMATCH {a} {name}: cli {body!r} vs ref {text!r}", file=sys.stderr)
        sl = slicing_from_log(cli_log)
        if sl:
            entry["slicing"] = sl
        chunks = []
        for ch in c["chunks"]:
            ch = dict(ch)
            if ch["type"] == "image":
                e = bins[a][ch["embd"]["bin_offset"]: ch["embd"]["bin_offset"] + ch["embd"]["count"]]
                key = (name, ch["index"])
                en = bins[a][ch["embd_no_flash_attn"]["bin_offset"]:][: ch["embd_no_flash_attn"]["count"]]
                if a == ARCHS[0]:
                    embd_map[key] = put(e)
                    embd_map[key + ("nofa",)] = put(en)
                else:
                    e0 = bins[ARCHS[0]][[cc for cc in runs[ARCHS[0]]["cases"] if cc["name"] == name][0]["chunks"][ch["index"]]["embd"]["bin_offset"]:][: e.size]
                    assert np.array_equal(e, e0), (name, ch["index"], "embeddings differ between text towers")
                ch["embd"] = dict(ch["embd"], bin_offset=embd_map[key])
                ch["embd_no_flash_attn"] = dict(ch["embd_no_flash_attn"], bin_offset=embd_map[key + ("nofa",)])
                if a != ARCHS[0]:  # the graph statistics are the same: keep them once
                    ch.pop("graph", None)
                    ch.pop("inp_raw", None)
            chunks.append(ch)
        entry["chunks"] = chunks
        for k in ("n_tokens_total", "n_pos_total", "helper_n_pos", "n_past_after_prompt", "generated", "eog_at", "text",
                  "text_hex", "text_plain_hex", "rows"):
            entry[k] = c[k]
        entry["logits0_bin_offset"] = put(bins[a][c["logits0_bin_offset"]: c["logits0_bin_offset"] + runs[a]["n_vocab"]])
        entry["llama_mtmd_cli" if c["images"] else "llama_completion"] = cli
        rr.append(entry)
    result_runs[a] = rr

# ---- images: file hashes, stb_image's decode vs Pillow's, preprocessed slices as PNGs ----
os.makedirs(f"{D}/preproc", exist_ok=True)
img_info = []
for c in runs[ARCHS[0]]["cases"]:
    if len(c["images"]) != 1:
        continue
    im = c["images"][0]
    path = f"{D}/{im['file']}"
    info = {"file": im["file"], "bytes": os.path.getsize(path), "sha256": sha(path), "stb_image": im}
    if im["loaded"]:
        rgb = np.fromfile(f"{T}/{c['name']}.0.rgb", dtype=np.uint8).reshape(im["ny"], im["nx"], 3)
        pil = np.asarray(Image.open(path).convert("RGBA" if path.endswith(".png") else "RGB"))[..., :3]
        diff = np.abs(rgb.astype(int) - pil.astype(int))
        info["stb_vs_pillow"] = {"equal": bool((diff == 0).all()), "max_abs_diff": int(diff.max()),
                                 "n_diff": int((diff != 0).sum()),
                                 "note": "Pillow: convert('RGBA')[..., :3] for PNG (alpha dropped, as stb_image's 3-channel load)"}
        info["rgb_sha256"] = hashlib.sha256(rgb.tobytes()).hexdigest()
        if not path.endswith(".png"):  # stb_image's decode, lossless, for tests that skip JPEG decoding
            png = f"preproc/{im['file'].rsplit('.', 1)[0]}.stb_rgb.png"
            Image.fromarray(rgb, "RGB").save(f"{D}/{png}", optimize=True)
            info["stb_rgb_png"] = png
        run = [r for r in result_runs[ARCHS[0]] if r["name"] == c["name"]][0]
        info["slicing"] = run.get("slicing")
        info["layout"] = "".join("".join(ch["pieces"]) if ch["type"] == "text" else f"[{ch['n_tokens']} embd]"
                                 for ch in run["chunks"])
        # llama.cpp's resize = Pillow's BICUBIC (a = -0.5, 22-bit fixed point) done as a horizontal pass, u8, then a
        # vertical pass; refined image: aspect-preserving resize (ceil) centred on a black canvas (PAD_CEIL)
        src = Image.fromarray(rgb)
        def pil_hv(img, w, h):
            if img.size[0] != w:
                img = img.resize((w, img.size[1]), Image.BICUBIC)
            if img.size[1] != h:
                img = img.resize((w, h), Image.BICUBIC)
            return img
        sl = (info["slicing"] or [None])[0]
        # preprocessed chunks (overview, slices) back to u8: v = (u8/255 - mean)/std
        pre = []
        for ch in c["chunks"]:
            if ch["type"] != "image":
                continue
            nx, ny = ch["inp_raw"]["ne"][:2]
            v = np.fromfile(f"{T}/{c['name']}.c{ch['index']}.inp_raw.f32", dtype="<f4").reshape(3, ny, nx)
            u = (v * STD + MEAN) * 255.0
            u8 = np.rint(u)
            err = float(np.abs(u - u8).max())
            assert err < 1e-3, err
            got = u8.astype(np.uint8).transpose(1, 2, 0)
            png = f"preproc/{im['file'].rsplit('.', 1)[0]}.c{ch['index']}.png"
            Image.fromarray(got, "RGB").save(f"{D}/{png}", optimize=True)
            k = len(pre)
            if k == 0:  # overview: direct resize (PAD_NONE)
                want = np.asarray(pil_hv(src, nx, ny))
            else:
                RW, RH = sl["refined"]
                W, H = src.size
                sc = min(RW / W, RH / H)
                nw, nh = min(math.ceil(W * sc), RW), min(math.ceil(H * sc), RH)
                canvas = Image.new("RGB", (RW, RH), (0, 0, 0))
                canvas.paste(pil_hv(src, nw, nh), ((RW - nw) // 2, (RH - nh) // 2))
                q = sl["slices"][k - 1]
                want = np.asarray(canvas)[q["y"]: q["y"] + q["h"], q["x"]: q["x"] + q["w"]]
            same = bool(np.array_equal(got, want))
            assert same, (im["file"], ch["index"], "preprocessing differs from the Pillow emulation")
            pre.append({"chunk": ch["index"], "nx": nx, "ny": ny, "png": png, "png_sha256": sha(f"{D}/{png}"),
                        "max_roundtrip_err_u8": err, "equals_pillow_emulation": same})
        info["preprocessed"] = pre
    img_info.append(info)

mm_keys, mm_tensors = gguf_keys("models/rand-minicpmv-mmproj.gguf")
models = {"mmproj": {"file": "models/rand-minicpmv-mmproj.gguf", "sha256": sha("models/rand-minicpmv-mmproj.gguf"),
                     "keys": mm_keys, "tensors": mm_tensors}}
for a in ARCHS:
    p = f"models/rand-{a}-vl.gguf"
    k, t = gguf_keys(p)
    k.pop("tokenizer.chat_template", None)
    models[a] = {"file": p, "sha256": sha(p), "keys": k, "tensors": t}

refs = {
    "format": "les-vision-refs-1",
    "llama_cpp": version,
    "system_info": runs[ARCHS[0]]["system_info"],
    "regenerate": ["python3 tools/make_vlm.py all", "tools/make_vision_refs.sh"],
    "commands": {
        "compile": compile_cmd,
        "mtmd_ref": f"target/tools/mtmd_ref --model models/rand-<arch>-vl.gguf --mmproj models/rand-minicpmv-mmproj.gguf "
                    f"--cases target/vision/cases.tsv --json target/vision/<arch>.json --bin target/vision/<arch>.bin "
                    f"--dump target/vision --threads {threads} --n-gen {n_gen} --ctx 4096 --top 8",
        "cases_tsv": [l for l in open(f"{T}/cases.tsv").read().splitlines()],
    },
    "params": runs[ARCHS[0]]["params"],
    "decode_use_mrope": runs[ARCHS[0]]["decode_use_mrope"],
    "n_embd": runs[ARCHS[0]]["n_embd"],
    "n_vocab": runs[ARCHS[0]]["n_vocab"],
    "bin": {"file": "refs.bin", "dtype": "little-endian f32",
            "note": "offsets/counts in f32 elements. chunks[].embd.bin_offset: n_tokens x n_embd image embeddings "
                    "(row-major, token-major: mtmd_get_output_embd after mtmd_encode_chunk; clip flash attention "
                    "auto = on, K/V cast to f16, as llama-mtmd-cli); chunks[].embd_no_flash_attn: the same with "
                    "flash attention off (f32 K/V, mul_mat + soft_max); the text tower was fed embd; logits0_bin_offset: n_vocab "
                    "logits of the last prompt position (the row that chose generated[0])"},
    "notes": {
        "inp_raw": "clip graph input, planar ggml [nx, ny, 3] (R plane, G plane, B plane; x fastest): "
                   "(u8/255 - mean)/std after llama.cpp's resize; preprocessed PNGs are the same pixels as u8",
        "decoder_pos": "mtmd_image_tokens_get_decoder_pos(chunk, pos_0, i): the 4 M-RoPE sections (t, y->section 1, "
                       "x->section 2, z) the helper passes to llama_decode for image embeddings",
        "graph": "statistics (sum, sumsq in f64 over memory order; first values) of named clip graph tensors, ggml ne order",
        "rows": "rows[i]: logits that chose generated[i] (top-8 with ids, margin top1-top2); generation stops at EOG like llama-mtmd-cli",
        "embeddings": "identical for both text towers (the same mmproj); stored once",
        "preprocessing": "images[].preprocessed: every chunk's clip input as u8 PNG; each equals the Pillow emulation "
                         "(overview: stb RGB resized with Pillow BICUBIC, horizontal pass then vertical pass; slices: "
                         "resize keeping aspect (ceil) to fit the refined size, centred on black, cropped) "
                         "(Pillow 13's own 2-D resize does the vertical pass first when that is cheaper: differs)",
        "jpeg": "stb_image decodes slice_400x240.jpg differently from Pillow/libjpeg-turbo (see stb_vs_pillow); "
                "preproc/slice_400x240.stb_rgb.png is stb's decode, losslessly",
    },
    "models": models,
    "images": img_info,
    "runs": result_runs,
}
json.dump(refs, open(f"{D}/refs.json", "w"), indent=1, ensure_ascii=False)
np.concatenate(out_bin).astype("<f4").tofile(f"{D}/refs.bin")
bad = [(a, r["name"]) for a in ARCHS for r in result_runs[a]
       if "error" not in r and not r.get("llama_mtmd_cli", r.get("llama_completion", {})).get("equals_mtmd_ref_text")]
print(f"refs.json: {os.path.getsize(D + '/refs.json')} bytes, refs.bin: {os.path.getsize(D + '/refs.bin')} bytes; "
      f"text mismatches vs llama.cpp CLIs: {bad or 'none'}", file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
