// Shared by tools/llama_ref.cpp and tools/mtmd_ref.cpp (LES's llama.cpp reference programs):
// JSON strings (invalid UTF-8 bytes become U+FFFD; the exact bytes are kept in *_hex fields), hex,
// the shortest decimal that round-trips an f32, a token's piece.
#pragma once

#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

inline bool utf8_valid_at(const std::string & s, size_t i, size_t & len) {
    unsigned char c = s[i];
    if (c < 0x80) { len = 1; return true; }
    int n;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; }
    else return false;
    if (i + n >= s.size()) return false;
    for (int k = 1; k <= n; k++) {
        unsigned char d = s[i + k];
        if ((d & 0xC0) != 0x80) return false;
        cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    len = n + 1;
    return true;
}

inline bool is_valid_utf8(const std::string & s) {
    size_t i = 0, len = 0;
    while (i < s.size()) {
        if (!utf8_valid_at(s, i, len)) return false;
        i += len;
    }
    return true;
}

inline std::string json_str(const std::string & s) {
    std::string o = "\"";
    size_t i = 0, len = 0;
    while (i < s.size()) {
        if (!utf8_valid_at(s, i, len)) { o += "\\ufffd"; i++; continue; }
        if (len == 1) {
            unsigned char c = s[i];
            switch (c) {
                case '"': o += "\\\""; break;
                case '\\': o += "\\\\"; break;
                case '\n': o += "\\n"; break;
                case '\r': o += "\\r"; break;
                case '\t': o += "\\t"; break;
                default:
                    if (c < 0x20) { char b[8]; snprintf(b, sizeof b, "\\u%04x", c); o += b; }
                    else o += (char) c;
            }
        } else {
            o.append(s, i, len);
        }
        i += len;
    }
    return o + "\"";
}

inline std::string hex(const std::string & s) {
    static const char * d = "0123456789abcdef";
    std::string o;
    for (unsigned char c : s) { o += d[c >> 4]; o += d[c & 15]; }
    return o;
}

// shortest decimal that round-trips an f32
inline std::string fmt_f32(float v) {
    if (std::isnan(v)) return "\"nan\"";
    if (std::isinf(v)) return v > 0 ? "\"inf\"" : "\"-inf\"";
    char b[32];
    for (int p = 6; p <= 9; p++) {
        snprintf(b, sizeof b, "%.*g", p, v);
        if (strtof(b, nullptr) == v) break;
    }
    return b;
}

inline std::string piece(const llama_vocab * vocab, llama_token t, bool special = true) {
    std::vector<char> buf(256);
    int n = llama_token_to_piece(vocab, t, buf.data(), (int) buf.size(), 0, special);
    if (n < 0) {
        buf.resize(-n);
        n = llama_token_to_piece(vocab, t, buf.data(), (int) buf.size(), 0, special);
    }
    return std::string(buf.data(), std::max(n, 0));
}
