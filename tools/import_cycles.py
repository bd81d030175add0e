#!/usr/bin/env python3
"""Import circles between the crate's source files (issue 35).

Reads every `use` declaration and every inline `crate::…` / `super::…` / `self::…` path in
src/**/*.rs, resolves each to the file of the module it names (an item path resolves to the
longest prefix that is a module file), and prints every strongly connected component of more
than one file in that graph: a set of files that import each other round in a circle. A
module's `mod` declarations are not imports (a parent owns its children), and `pub use`
re-exports count like any other import. Exit status 1 when a circle exists.

  python3 tools/import_cycles.py [src]
"""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "src"


def module_of(path):
    rel = os.path.relpath(path, root)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib"):
        rel = rel[:-1]
    return tuple(rel)


files = {}
for d, _, fs in os.walk(root):
    for f in fs:
        if f.endswith(".rs"):
            p = os.path.join(d, f)
            if os.path.basename(d) == "bin" or os.sep + "bin" + os.sep in p:
                continue
            files[module_of(p)] = p
mods = set(files)


def strip(text):
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return text


def expand(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = tree.strip()
    i = tree.find("{")
    if i < 0:
        return [tree.split(" as ")[0].strip()]
    prefix, inner = tree[:i], tree[i + 1 : tree.rindex("}")]
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        if p.strip():
            out += [prefix + q if q != "self" else prefix.rstrip(":") for q in expand(p)]
    return out


def resolve(mod, path):
    segs = [s for s in path.split("::") if s]
    if not segs:
        return None
    if segs[0] == "crate":
        base, segs = [], segs[1:]
    elif segs[0] in ("super", "self"):
        base = list(mod)
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
    else:
        return None
    best = None
    for n in range(len(segs) + 1):
        cand = tuple(base + segs[:n])
        if cand in mods:
            best = cand
    return best


# A file's own inline `mod x { … }` blocks (tests) are parts of it; their `super::` is the file.
edges = {m: set() for m in mods}
for m, p in files.items():
    text = strip(open(p, encoding="utf-8").read())
    text = re.sub(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{.*", "", text, flags=re.S)
    paths = []
    for u in re.finditer(r"\buse\s+([^;]+);", text):
        paths += expand(u.group(1))
    paths += re.findall(r"\b((?:crate|super|self)(?:::\w+)+)", text)
    for path in paths:
        t = resolve(m, path)
        if t is not None and t != m and t[: len(m)] != m and m[: len(t)] != t:
            edges[m].add(t)

# Tarjan's strongly connected components.
index, low, stack, on, comps, n = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)


def visit(v):
    index[v] = low[v] = n[0]
    n[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges[v]:
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.remove(w)
            comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            comps.append(comp)


for v in sorted(mods):
    if v not in index:
        visit(v)

name = lambda m: files[m]
for c in comps:
    cs = set(c)
    print("circle: " + ", ".join(sorted(name(m) for m in c)))
    for m in sorted(c):
        for t in sorted(edges[m] & cs):
            print(f"  {name(m)} -> {name(t)}")
print(f"{len(files)} files, {sum(len(e) for e in edges.values())} imports, {len(comps)} circles")
sys.exit(1 if comps else 0)
