#!/usr/bin/python3
"""Generates common/tokenizer_unicode_tables.c: the Unicode data the tokenizer
needs, as compact sorted tables.

  - character classes for the pre-tokenizer regexes (letters by general
    category, marks, numbers, punctuation, symbols, White_Space), as ranges;
  - NFC data: canonical combining classes, full canonical decompositions,
    primary composites, and the characters that can change under NFC.

The data comes from node's ICU (its Unicode version, 17.0 with node 20.20),
which is newer than the unicodedata of any Python on the build machines:
general categories and White_Space through regex property escapes,
decompositions and composites through String.prototype.normalize, and the
combining classes by comparing each mark's canonical ordering against one
representative of every class value (classes never change once assigned,
so Python's unicodedata supplies the representatives). Run:

    /usr/bin/python3 tools/gen_unicode_tables.py > common/tokenizer_unicode_tables.c
"""
import json
import subprocess
import sys
import unicodedata as ud

MAX_CP = 0x110000

# Bits of a character's class; must match common/tokenizer_unicode.h.
LU, LL, LT, LM, LO, M, N, WS, P, S = 1, 2, 4, 8, 16, 32, 64, 128, 256, 512
CATEGORY_BITS = {"Lu": LU, "Ll": LL, "Lt": LT, "Lm": LM, "Lo": LO, "M": M, "N": N, "P": P, "S": S}

SBASE, LBASE, VBASE, TBASE = 0xAC00, 0x1100, 0x1161, 0x11A7
LCOUNT, VCOUNT, TCOUNT = 19, 21, 28
SCOUNT = LCOUNT * VCOUNT * TCOUNT

# Runs in node: prints one JSON object with the data for every code point.
NODE_PROGRAM = r"""
const reps = JSON.parse(process.argv[1]);  // [[ccc, cp], ...] sorted by ccc
const cats = Object.entries(%s).map(([k, v]) => [new RegExp("^\\p{" + (k.length == 1 ? "gc=" + k : k) + "}$", "u"), v]);
const ws = /^\p{White_Space}$/u;
const MAX = 0x110000;
const cls = new Array(MAX).fill(0), ccc = {}, nfd = {}, nfc_changes = [], unknown = [];
const order = (a, b) => String.fromCodePoint(a, b).normalize("NFD") == String.fromCodePoint(a, b) ? 0 : 1;
for (let cp = 0; cp < MAX; cp++) {
  if (cp >= 0xD800 && cp <= 0xDFFF) continue;
  const ch = String.fromCodePoint(cp);
  if (ws.test(ch)) cls[cp] = %d;
  else for (const [re, bit] of cats) if (re.test(ch)) { cls[cp] = bit; break; }
  const d = ch.normalize("NFD");
  if (d != ch) nfd[cp] = Array.from(d).map((c) => c.codePointAt(0));
  if (ch.normalize("NFC") != ch) nfc_changes.push(cp);
  if (d != ch || !(cls[cp] & %d)) continue;  // only marks have a non-zero class
  // "x r" reorders when ccc(x) > ccc(r) > 0; "r x" when 0 < ccc(x) < ccc(r).
  const [lo, hi] = [reps[0][1], reps[reps.length - 1][1]];
  if (!order(cp, lo) && !order(hi, cp)) continue;  // class 0
  const same = reps.find(([v, r]) => !order(cp, r) && !order(r, cp));
  if (same) ccc[cp] = same[0]; else unknown.push(cp);
}
process.stdout.write(JSON.stringify({version: process.versions.unicode, cls, ccc, nfd, nfc_changes, unknown}));
"""


def node_data():
    reps = {}
    for cp in range(MAX_CP):
        c = ud.combining(chr(cp))
        if c and c not in reps and ud.decomposition(chr(cp)) == "":
            reps[c] = cp
    reps = sorted(reps.items())
    program = NODE_PROGRAM % (json.dumps(CATEGORY_BITS), WS, M)
    out = subprocess.run(["node", "-e", program, json.dumps(reps)], check=True,
                         capture_output=True, text=True).stdout
    data = json.loads(out)
    if data["unknown"]:
        sys.exit("gen_unicode_tables: combining class values with no representative: " +
                 " ".join(f"U+{cp:04X}" for cp in data["unknown"]))
    data["nfd"] = {int(k): v for k, v in data["nfd"].items()}
    data["ccc"] = {int(k): v for k, v in data["ccc"].items()}
    # Marks that decompose take their class from Python (they are all old).
    for cp in data["nfd"]:
        if ud.combining(chr(cp)):
            data["ccc"][cp] = ud.combining(chr(cp))
    return data


def ranges(values):
    """(first, last, value) runs of equal non-zero values over code points."""
    out = []
    for cp in sorted(values):
        v = values[cp]
        if out and out[-1][1] == cp - 1 and out[-1][2] == v:
            out[-1] = (out[-1][0], cp, v)
        else:
            out.append((cp, cp, v))
    return out


def main():
    data = node_data()
    version = data["version"]
    cls = data["cls"]
    decomps = {cp: d for cp, d in data["nfd"].items() if not SBASE <= cp < SBASE + SCOUNT}
    # Primary composites: characters NFC keeps whose decomposition has two
    # or more characters. Their first part is the character NFC keeps whose
    # decomposition is all but the last one (or that one character itself).
    changes = set(data["nfc_changes"])
    kept_by_decomp = {tuple(d): cp for cp, d in decomps.items() if cp not in changes}
    composites = []  # (first, second, composite)
    for cp, d in decomps.items():
        if len(d) < 2 or cp in changes:
            continue
        first = d[0] if len(d) == 2 else kept_by_decomp.get(tuple(d[:-1]))
        if first is None:
            sys.exit(f"gen_unicode_tables: no first part for U+{cp:04X}")
        composites.append((first, d[-1], cp))
    composites.sort()
    seconds = {b for _, b, _ in composites}
    ccc = data["ccc"]

    # Characters whose presence means NFC may change the text around them:
    # non-zero combining class, NFC(c) != c, or able to combine with the
    # character before it (including Hangul V and T jamo). Text made only of
    # other characters is already NFC, and NFC can be applied piecewise
    # between them.
    unsafe = []
    for cp in range(MAX_CP):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        bad = (cp in ccc or cp in changes or cp in seconds
               or VBASE <= cp < VBASE + VCOUNT or TBASE < cp < TBASE + TCOUNT)
        if not bad:
            continue
        if unsafe and unsafe[-1][1] == cp - 1:
            unsafe[-1] = (unsafe[-1][0], cp)
        else:
            unsafe.append((cp, cp))

    starts, classes = [], []
    for cp in range(MAX_CP):
        if not classes or cls[cp] != classes[-1]:
            starts.append(cp)
            classes.append(cls[cp])
    cccs = ranges(ccc)
    w = sys.stdout.write
    w("/* Generated by tools/gen_unicode_tables.py from node's ICU "
      f"(Unicode {version}).\n * Do not edit; rerun the script. */\n")
    w('#include "common/tokenizer_unicode.h"\n\n')
    w(f'const char loom_uc_version[] = "{version}";\n\n')

    def emit_u32(name, vals, per_line=8, fmt="0x{:05X}"):
        w(f"const uint32_t {name}[{len(vals)}] = {{\n")
        for i in range(0, len(vals), per_line):
            w("    " + ", ".join(fmt.format(v) for v in vals[i:i + per_line]) + ",\n")
        w("};\n")

    def emit_int(name, ctype, vals, per_line=16):
        w(f"const {ctype} {name}[{len(vals)}] = {{\n")
        for i in range(0, len(vals), per_line):
            w("    " + ", ".join(str(v) for v in vals[i:i + per_line]) + ",\n")
        w("};\n")

    emit_int("loom_uc_ascii_class", "uint16_t", cls[:128])
    w(f"\nconst int loom_uc_class_n = {len(starts)};\n")
    emit_u32("loom_uc_class_start", starts)
    emit_int("loom_uc_class_bits", "uint16_t", classes)

    w(f"\nconst int loom_uc_ccc_n = {len(cccs)};\n")
    emit_u32("loom_uc_ccc_first", [a for a, _, _ in cccs])
    emit_u32("loom_uc_ccc_last", [b for _, b, _ in cccs])
    emit_int("loom_uc_ccc_value", "uint8_t", [c for _, _, c in cccs])
    keys = sorted(decomps)
    flat, offs = [], []
    for cp in keys:
        offs.append(len(flat) | (len(decomps[cp]) << 16))
        flat.extend(decomps[cp])
    w(f"\nconst int loom_uc_decomp_n = {len(keys)};\n")
    emit_u32("loom_uc_decomp_cp", keys)
    w("/* offset into loom_uc_decomp_data | length << 16 */\n")
    emit_u32("loom_uc_decomp_index", offs, fmt="0x{:06X}")
    emit_u32("loom_uc_decomp_data", flat)

    w(f"\nconst int loom_uc_comp_n = {len(composites)};\n")
    w("/* sorted by first << 21 | second */\n")
    emit_u32("loom_uc_comp_first", [a for a, _, _ in composites])
    emit_u32("loom_uc_comp_second", [b for _, b, _ in composites])
    emit_u32("loom_uc_comp_result", [c for _, _, c in composites])

    w(f"\nconst int loom_uc_nfc_unsafe_n = {len(unsafe)};\n")
    emit_u32("loom_uc_nfc_unsafe_first", [a for a, _ in unsafe])
    emit_u32("loom_uc_nfc_unsafe_last", [b for _, b in unsafe])


if __name__ == "__main__":
    main()
