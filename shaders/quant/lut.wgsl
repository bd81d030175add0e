// Shared by IQ4_NL, IQ4_XS and MXFP4: four nibbles (at `shift` in each byte of q) looked up in a
// 16-entry int8 code book KV, packed as four int8 lanes.
fn lut4(q: u32, shift: u32) -> u32 {
    var r = 0u;
    for (var i = 0u; i < 4u; i++) {
        r |= (u32(KV[(q >> (8u * i + shift)) & 15u]) & 0xffu) << (8u * i);
    }
    return r;
}
