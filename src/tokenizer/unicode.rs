//! Code point classes and the GPT-2 byte alphabet, as llama.cpp's pre-tokenizers see them.
//!
//! llama.cpp (`src/unicode.cpp`, `src/unicode.h`) gives every code point one general-category
//! class (number, letter, separator, mark, punctuation, symbol, control, or undefined for
//! unassigned code points) plus a white-space bit. Its tables were generated from Unicode 15.1;
//! `unicode_data.rs` holds the same classes, generated from the `regex` crate's Unicode tables
//! restricted to code points assigned by Unicode 15.1 (see `tests/suite/tokenizer_unicode.rs`).

use super::unicode_data::{CATEGORY_STARTS, CATEGORY_VALUES};

/// Class bits. Values follow the meaning (not necessarily the layout) of llama.cpp's
/// `unicode_cpt_flags`. A position outside the text has no bits at all ([`Flags::NONE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct Flags(u16);

pub(crate) const UNDEFINED: u16 = 0x0001;
pub(crate) const NUMBER: u16 = 0x0002;
pub(crate) const LETTER: u16 = 0x0004;
pub(crate) const SEPARATOR: u16 = 0x0008;
pub(crate) const MARK: u16 = 0x0010;
pub(crate) const PUNCTUATION: u16 = 0x0020;
pub(crate) const SYMBOL: u16 = 0x0040;
pub(crate) const CONTROL: u16 = 0x0080;
pub(crate) const WHITESPACE: u16 = 0x0100;

/// Category codes used in the generated table, in this order.
const CATEGORY_BITS: [u16; 8] = [UNDEFINED, NUMBER, LETTER, SEPARATOR, MARK, PUNCTUATION, SYMBOL, CONTROL];

impl Flags {
    pub(crate) const NONE: Flags = Flags(0);
    #[inline]
    pub(crate) fn is_some(self) -> bool {
        self.0 != 0
    }
    #[inline]
    pub(crate) fn is_letter(self) -> bool {
        self.0 & LETTER != 0
    }
    #[inline]
    pub(crate) fn is_number(self) -> bool {
        self.0 & NUMBER != 0
    }
    #[inline]
    pub(crate) fn is_whitespace(self) -> bool {
        self.0 & WHITESPACE != 0
    }
}

/// Unicode `White_Space` property (PropList.txt), the set llama.cpp treats as `\s`.
#[inline]
pub(crate) fn is_whitespace(cp: u32) -> bool {
    matches!(cp, 0x09..=0x0d | 0x20 | 0x85 | 0xa0 | 0x1680 | 0x2000..=0x200a | 0x2028 | 0x2029 | 0x202f | 0x205f | 0x3000)
}

/// General-category bit of a code point (one of the category constants).
#[inline]
pub(crate) fn category(cp: u32) -> u16 {
    if cp >= 0x11_0000 {
        return UNDEFINED;
    }
    // Index of the last range starting at or before cp. CATEGORY_STARTS[0] == 0.
    let i = CATEGORY_STARTS.partition_point(|&s| s <= cp) - 1;
    CATEGORY_BITS[CATEGORY_VALUES[i] as usize & 7]
}

/// Flags of one code point.
#[inline]
pub(crate) fn flags(cp: u32) -> Flags {
    let mut f = category(cp);
    if is_whitespace(cp) {
        f |= WHITESPACE;
    }
    Flags(f)
}

/// The printable character GPT-2's byte-level BPE uses for each byte (`bytes_to_unicode` in
/// OpenAI's encoder.py; llama.cpp: `unicode_byte_to_utf8` in `src/unicode.cpp`). Bytes that are
/// printable Latin-1 map to themselves; the other 68 map to U+0100.. in byte order.
pub(crate) fn byte_to_char(b: u8) -> char {
    BYTE_TO_CHAR[b as usize]
}

/// Inverse of [`byte_to_char`].
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp < 256 {
        let b = cp as u8;
        return if self_mapped(b) { Some(b) } else { None };
    }
    if (256..256 + 68).contains(&cp) {
        return Some(UNMAPPED_BYTES[(cp - 256) as usize]);
    }
    None
}

const fn self_mapped(b: u8) -> bool {
    matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff)
}

/// The 68 bytes that are not printable Latin-1, ascending.
const UNMAPPED_BYTES: [u8; 68] = {
    let mut out = [0u8; 68];
    let mut n = 0;
    let mut b = 0usize;
    while b < 256 {
        if !self_mapped(b as u8) {
            out[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    out
};

const BYTE_TO_CHAR: [char; 256] = {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    let mut b = 0usize;
    while b < 256 {
        if self_mapped(b as u8) {
            out[b] = match char::from_u32(b as u32) {
                Some(c) => c,
                None => '\0',
            };
        } else {
            out[b] = match char::from_u32(256 + n) {
                Some(c) => c,
                None => '\0',
            };
            n += 1;
        }
        b += 1;
    }
    out
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_round_trips() {
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(char_to_byte('A'), Some(b'A'));
        assert_eq!(char_to_byte('\u{1F600}'), None);
    }

    #[test]
    fn classes() {
        assert!(flags('a' as u32).is_letter());
        assert!(flags('é' as u32).is_letter());
        assert!(flags('7' as u32).is_number());
        assert!(flags('²' as u32).is_number());
        assert!(flags(' ' as u32).is_whitespace());
        assert_eq!(category('!' as u32), PUNCTUATION);
        assert_eq!(category('$' as u32), SYMBOL);
        assert_eq!(category(0x301), MARK);
        assert_eq!(category(0x0378), UNDEFINED);
        assert_eq!(category(0x0), CONTROL);
        assert_eq!(category(0x3000), SEPARATOR);
        assert_eq!(category(0x1F600), SYMBOL);
        // Assigned in Unicode 16 only: llama.cpp's 15.1 tables call it unassigned.
        assert_eq!(category(0x1C89), UNDEFINED);
        assert_eq!(category(0x2EBF0), LETTER);
    }
}
