//! The `--verify` pattern: every 8-byte word depends on its position and a seed.
//!
//! A block that lands at the wrong offset, a stale byte from an earlier point (another
//! seed) and a byte that never moved (destinations are filled with the complement
//! first) all differ from the expected pattern.

use std::ops::Range;

use te::{Buffer, Error, ErrorKind, Result};

/// Bytes filled or checked per `Buffer::write`/`read` call.
const CHUNK: usize = 1 << 20;

/// A seeded pattern, or its bitwise complement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pattern {
    seed: u64,
    inverted: bool,
}

impl Pattern {
    /// The pattern of `seed`.
    pub(crate) fn new(seed: u64) -> Pattern {
        Pattern {
            seed,
            inverted: false,
        }
    }

    /// The complement: no byte equals the pattern's byte at the same offset.
    pub(crate) fn inverted(self) -> Pattern {
        Pattern {
            inverted: !self.inverted,
            ..self
        }
    }

    fn word(&self, index: u64) -> u64 {
        let w = index.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ self.seed;
        if self.inverted {
            !w
        } else {
            w
        }
    }

    /// Writes the pattern's bytes for buffer offsets `start .. start + out.len()`.
    pub(crate) fn render(&self, start: u64, out: &mut [u8]) {
        let mut pos = start;
        let mut rest = out;
        // Up to the first 8-byte boundary, byte by byte; then whole words.
        while pos % 8 != 0 && !rest.is_empty() {
            rest[0] = self.word(pos / 8).to_le_bytes()[(pos % 8) as usize];
            rest = &mut rest[1..];
            pos += 1;
        }
        let mut words = rest.chunks_exact_mut(8);
        for w in &mut words {
            w.copy_from_slice(&self.word(pos / 8).to_le_bytes());
            pos += 8;
        }
        let tail = words.into_remainder();
        let bytes = self.word(pos / 8).to_le_bytes();
        tail.copy_from_slice(&bytes[..tail.len()]);
    }
}

/// Fills `range` of `buf` with `pattern`.
///
/// # Errors
/// `OutOfBounds` if the range is outside the buffer.
pub(crate) fn fill(buf: &Buffer, range: Range<u64>, pattern: Pattern) -> Result<()> {
    let mut scratch = vec![0u8; CHUNK.min((range.end - range.start) as usize)];
    let mut at = range.start;
    while at < range.end {
        let n = CHUNK.min((range.end - at) as usize);
        pattern.render(at, &mut scratch[..n]);
        buf.write(at as usize, &scratch[..n])?;
        at += n as u64;
    }
    Ok(())
}

/// Checks that `range` of `buf` holds `pattern`.
///
/// # Errors
/// `InvalidRequest` naming the first differing offset, what was expected and found,
/// and how many bytes of the range differ.
pub(crate) fn check(buf: &Buffer, range: Range<u64>, pattern: Pattern, what: &str) -> Result<()> {
    let len = CHUNK.min((range.end - range.start) as usize);
    let (mut expected, mut found) = (vec![0u8; len], vec![0u8; len]);
    let mut first = None;
    let mut wrong = 0u64;
    let mut at = range.start;
    while at < range.end {
        let n = CHUNK.min((range.end - at) as usize);
        pattern.render(at, &mut expected[..n]);
        buf.read(at as usize, &mut found[..n])?;
        if expected[..n] != found[..n] {
            for (i, (e, f)) in expected[..n].iter().zip(&found[..n]).enumerate() {
                if e != f {
                    wrong += 1;
                    first.get_or_insert((at + i as u64, *e, *f));
                }
            }
        }
        at += n as u64;
    }
    match first {
        None => Ok(()),
        Some((offset, e, f)) => Err(Error::new(
            ErrorKind::InvalidRequest,
            format!(
                "verify failed: {wrong} of {} bytes of the {what} differ from the pattern; the first at offset {offset}: expected {e:#04x}, found {f:#04x}",
                range.end - range.start
            ),
        )
        .with_operation("bench")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendering_from_any_offset_agrees_with_rendering_from_zero() {
        let p = Pattern::new(42);
        let mut whole = vec![0u8; 100];
        p.render(0, &mut whole);
        for start in [0usize, 1, 7, 8, 13] {
            let mut part = vec![0u8; 100 - start - 3];
            p.render(start as u64, &mut part);
            assert_eq!(part, whole[start..97], "start {start}");
        }
    }

    #[test]
    fn the_complement_and_another_seed_differ_everywhere_that_matters() {
        let (mut a, mut b, mut c) = (vec![0u8; 4096], vec![0u8; 4096], vec![0u8; 4096]);
        Pattern::new(7).render(0, &mut a);
        Pattern::new(7).inverted().render(0, &mut b);
        Pattern::new(8).render(0, &mut c);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert_ne!(a, c);
        let mut shifted = vec![0u8; 4096];
        Pattern::new(7).render(4096, &mut shifted);
        assert_ne!(a, shifted, "a block at the wrong offset is caught");
    }

    #[test]
    fn check_finds_a_single_wrong_byte_in_a_buffer() {
        let engine = te::Engine::from_config(&te::Config::defaults()).unwrap();
        let buf = engine.alloc("b", 3 << 20, te::Access::LOCAL).unwrap();
        let p = Pattern::new(3);
        fill(&buf, 0..(3 << 20), p).unwrap();
        check(&buf, 0..(3 << 20), p, "buffer").unwrap();
        let mut byte = [0u8];
        buf.read(2_000_001, &mut byte).unwrap();
        buf.write(2_000_001, &[!byte[0]]).unwrap();
        let e = check(&buf, 0..(3 << 20), p, "buffer").unwrap_err();
        assert!(
            e.to_string().contains("1 of 3145728 bytes")
                && e.to_string().contains("offset 2000001"),
            "{e}"
        );
        check(&buf, 0..2_000_000, p, "buffer").unwrap();
    }
}
