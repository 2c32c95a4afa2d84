//! The data-connection wire format: pure functions over bytes, no I/O.
//!
//! Every field is written explicitly, little-endian; nothing is a struct's raw bytes.
//!
//! **Handshake** (once per connection, before any data):
//!
//! | message    | direction | bytes | fields |
//! |------------|-----------|-------|--------|
//! | `Hello`    | initiator → target | 48 | magic `TETC`, version u16, flags u16 (0), the target instance the initiator expects u64, initiator nonce \[32\] |
//! | `Challenge`| target → initiator | 44 | magic, version u16, status u16, auth u8 (1 = a token is required), 3 zero bytes, target nonce \[32\] |
//! | `Terms`    | target → initiator | 12 | magic, the largest payload u64 the target accepts in one frame (its `slice_size`); sent right after a `Challenge` with status `Ok` (since version 2) |
//! | `Proof`    | initiator → target | 36 | magic, HMAC \[32\] (zeros without a token) |
//! | `Welcome`  | target → initiator | 40 | magic, status u16, 2 zero bytes, HMAC \[32\] (the target's own proof) |
//!
//! **Frames** (after the handshake): a fixed 40-byte [`Header`], then for `Write` and
//! `ReadData` `len` payload bytes, for `Error` a `len`-byte UTF-8 message. The
//! scatter-gather requests `WriteV` and `ReadV` (since version 3) name one region and
//! carry their entry count `n` in `code`, `offset` 0 and the total `len`; `n` [`Entry`]s
//! of 16 bytes (offset u64, len u64) follow the header, then for `WriteV` the `len`
//! payload bytes, the entries' bytes one after another. Each is answered like one
//! request: one `WriteAck`, one `ReadData` of `len` bytes (the entries' bytes in order),
//! or one `Error` refusing the whole frame.
//!
//! | offset | field |
//! |--------|-------|
//! | 0      | kind u8 |
//! | 1..4   | zero |
//! | 4..8   | code u32 (an error kind's code in `Error`, else 0) |
//! | 8..16  | request id u64 |
//! | 16..24 | region u64 (requests; 0 in responses) |
//! | 24..32 | offset u64 (requests; 0 in responses) |
//! | 32..40 | len u64 |
//!
//! A target answers the requests of one connection in order, each with exactly one
//! `WriteAck`, `ReadData` or `Error` carrying the request's id.
//!
//! **Frame limits.** The initiator cuts requests into slices no longer than the
//! target's `Terms` (and its own `slice_size`). A request longer than the target
//! announced is answered with an `Error` (`InvalidRequest`) naming both lengths, and
//! the target closes the connection: the payload that follows cannot be placed, and a
//! peer that ignores the agreed terms is not trusted with the rest of the stream.
//!
//! **Scatter-gather limits.** A frame lists 1..=[`MAX_ENTRIES`] entries (so its entry
//! list is at most 16 KiB), none empty or overflowing, whose lengths add up to exactly
//! `len`, itself within the frame limit. A frame that breaks these rules is a protocol
//! error and closes the connection before any payload byte is read. A well-formed frame
//! with an entry outside the region (or a region without the right) is refused whole
//! with one `Error`, its payload received and dropped, as for `Write`.
//!
//! Version 1 had no `Terms`, version 2 no scatter-gather frames: a version-3 side
//! refuses an older peer with status `Version`, which every version understands.

use thiserror::Error;

/// The protocol version both sides must speak (2: the target announces its frame limit;
/// 3: scatter-gather frames).
pub(crate) const VERSION: u16 = 3;
/// The smallest frame limit a target may announce (the smallest `slice_size`).
pub(crate) const MIN_PAYLOAD: u64 = 4096;
/// The first bytes of every handshake message.
pub(crate) const MAGIC: [u8; 4] = *b"TETC";
/// Bytes of a frame header.
pub(crate) const HEADER_LEN: usize = 40;
/// The largest payload one frame may carry (a slice); larger requests are sliced.
pub(crate) const MAX_PAYLOAD: u64 = 64 << 20;
/// The most entries one scatter-gather frame may list.
pub(crate) const MAX_ENTRIES: usize = 1024;
/// Bytes of one scatter-gather entry.
pub(crate) const ENTRY_LEN: usize = 16;
/// The longest error message a frame may carry.
pub(crate) const MAX_MESSAGE: u64 = 4096;
/// Bytes of a nonce.
pub(crate) const NONCE_LEN: usize = 32;
const MAC_LEN: usize = te_core::auth::LEN;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Initiator → target: `len` payload bytes for `region[offset..]` follow.
    Write = 1,
    /// Initiator → target: send `region[offset..offset + len]`.
    Read = 2,
    /// Target → initiator: the write with this id is in place.
    WriteAck = 3,
    /// Target → initiator: `len` bytes answering the read with this id follow.
    ReadData = 4,
    /// Target → initiator: the request with this id was refused; a message follows.
    Error = 5,
    /// Initiator → target: `code` entries, then `len` payload bytes for them.
    WriteV = 6,
    /// Initiator → target: `code` entries; send their bytes, `len` in all.
    ReadV = 7,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Write,
            2 => Kind::Read,
            3 => Kind::WriteAck,
            4 => Kind::ReadData,
            5 => Kind::Error,
            6 => Kind::WriteV,
            7 => Kind::ReadV,
            _ => return None,
        })
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) code: u32,
    pub(crate) id: u64,
    pub(crate) region: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// Why bytes are not a valid frame or handshake message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub(crate) enum WireError {
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("reserved header bytes are not zero")]
    Reserved,
    #[error("a {kind:?} frame must not carry field `{field}`")]
    UnexpectedField { kind: Kind, field: &'static str },
    #[error("a {kind:?} frame of {len} bytes is outside 1..={max}")]
    BadLength { kind: Kind, len: u64, max: u64 },
    #[error("offset {offset} + length {len} overflows")]
    Overflow { offset: u64, len: u64 },
    #[error("an error frame carries no error code")]
    NoCode,
    #[error("bad magic {0:02x?}: not a te-tcp peer")]
    Magic([u8; 4]),
    #[error("handshake field `{0}` has an invalid value")]
    Field(&'static str),
    #[error("a scatter-gather frame lists {0} entries, outside 1..={MAX_ENTRIES}")]
    Entries(u32),
    #[error("scatter-gather entry {index} ({offset}+{len}) is empty or overflows")]
    BadEntry { index: usize, offset: u64, len: u64 },
    #[error("the entries of a scatter-gather frame add up to {sum} bytes, its header says {len}")]
    EntrySum { sum: u64, len: u64 },
    #[error("truncated: {got} of {need} bytes")]
    Truncated { got: usize, need: usize },
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn need(b: &[u8], n: usize) -> Result<(), WireError> {
    if b.len() < n {
        Err(WireError::Truncated {
            got: b.len(),
            need: n,
        })
    } else {
        Ok(())
    }
}

impl Header {
    /// A request header.
    pub(crate) fn request(kind: Kind, id: u64, region: u64, offset: u64, len: u64) -> Header {
        Header {
            kind,
            code: 0,
            id,
            region,
            offset,
            len,
        }
    }

    /// A response header.
    pub(crate) fn response(kind: Kind, code: u32, id: u64, len: u64) -> Header {
        Header {
            kind,
            code,
            id,
            region: 0,
            offset: 0,
            len,
        }
    }

    /// The header's bytes.
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.kind as u8;
        b[4..8].copy_from_slice(&self.code.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.region.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and checks the first [`HEADER_LEN`] bytes of `b`.
    ///
    /// # Errors
    /// [`WireError`] for anything a well-behaved peer never sends: a short buffer, an
    /// unknown kind, non-zero reserved bytes, fields that do not belong to the kind, a
    /// length outside the frame limits, or an overflowing range.
    pub(crate) fn decode(b: &[u8]) -> Result<Header, WireError> {
        need(b, HEADER_LEN)?;
        let kind = Kind::from_u8(b[0]).ok_or(WireError::UnknownKind(b[0]))?;
        if b[1..4] != [0, 0, 0] {
            return Err(WireError::Reserved);
        }
        let h = Header {
            kind,
            code: u32_at(b, 4),
            id: u64_at(b, 8),
            region: u64_at(b, 16),
            offset: u64_at(b, 24),
            len: u64_at(b, 32),
        };
        let unexpected = |field| Err(WireError::UnexpectedField { kind, field });
        let bad_len = |max| {
            Err(WireError::BadLength {
                kind,
                len: h.len,
                max,
            })
        };
        match kind {
            Kind::WriteV | Kind::ReadV => {
                if h.code == 0 || h.code as usize > MAX_ENTRIES {
                    return Err(WireError::Entries(h.code));
                }
                if h.offset != 0 {
                    return unexpected("offset");
                }
                if h.len == 0 || h.len > MAX_PAYLOAD {
                    return bad_len(MAX_PAYLOAD);
                }
            }
            Kind::Write | Kind::Read => {
                if h.code != 0 {
                    return unexpected("code");
                }
                if h.len == 0 || h.len > MAX_PAYLOAD {
                    return bad_len(MAX_PAYLOAD);
                }
                if h.offset.checked_add(h.len).is_none() {
                    return Err(WireError::Overflow {
                        offset: h.offset,
                        len: h.len,
                    });
                }
            }
            Kind::WriteAck | Kind::ReadData | Kind::Error => {
                if h.region != 0 {
                    return unexpected("region");
                }
                if h.offset != 0 {
                    return unexpected("offset");
                }
                match kind {
                    Kind::WriteAck if h.code != 0 => return unexpected("code"),
                    Kind::WriteAck if h.len != 0 => return unexpected("len"),
                    Kind::ReadData if h.code != 0 => return unexpected("code"),
                    Kind::ReadData if h.len == 0 || h.len > MAX_PAYLOAD => {
                        return bad_len(MAX_PAYLOAD)
                    }
                    Kind::Error if h.code == 0 => return Err(WireError::NoCode),
                    Kind::Error if h.len == 0 || h.len > MAX_MESSAGE => {
                        return bad_len(MAX_MESSAGE)
                    }
                    _ => {}
                }
            }
        }
        Ok(h)
    }
}

/// One entry of a scatter-gather frame: `len` bytes at `offset` in the frame's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

impl Entry {
    /// Appends the entry's bytes to `out`.
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }
}

impl Header {
    /// The number of entries a scatter-gather header announces (0 for other kinds).
    pub(crate) fn entries(&self) -> usize {
        match self.kind {
            Kind::WriteV | Kind::ReadV => self.code as usize,
            _ => 0,
        }
    }

    /// Bytes of the entry list that follows this header.
    pub(crate) fn entries_len(&self) -> usize {
        self.entries() * ENTRY_LEN
    }
}

/// Decodes the entry list of the scatter-gather header `h` from `b` into `out`
/// (cleared first).
///
/// # Errors
/// Truncated input, an empty or overflowing entry, or entries that do not add up to the
/// header's `len`.
pub(crate) fn decode_entries(h: &Header, b: &[u8], out: &mut Vec<Entry>) -> Result<(), WireError> {
    out.clear();
    let n = h.entries();
    need(b, n * ENTRY_LEN)?;
    let mut sum = 0u64;
    for index in 0..n {
        let at = index * ENTRY_LEN;
        let e = Entry {
            offset: u64_at(b, at),
            len: u64_at(b, at + 8),
        };
        if e.len == 0 || e.offset.checked_add(e.len).is_none() {
            return Err(WireError::BadEntry {
                index,
                offset: e.offset,
                len: e.len,
            });
        }
        sum = sum.saturating_add(e.len);
        out.push(e);
    }
    if sum != h.len {
        return Err(WireError::EntrySum { sum, len: h.len });
    }
    Ok(())
}

/// Handshake statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Go on.
    Ok = 0,
    /// The target does not speak the initiator's version.
    Version = 1,
    /// The initiator expects another instance: the target restarted since.
    WrongInstance = 2,
    /// The initiator did not prove the token.
    AuthFailed = 3,
}

impl Status {
    fn from_u16(v: u16) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::Version,
            2 => Status::WrongInstance,
            3 => Status::AuthFailed,
            _ => return None,
        })
    }
}

fn magic(b: &[u8]) -> Result<(), WireError> {
    if b[..4] != MAGIC {
        let mut m = [0u8; 4];
        m.copy_from_slice(&b[..4]);
        return Err(WireError::Magic(m));
    }
    Ok(())
}

/// Initiator → target: who the initiator expects, and its nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) version: u16,
    pub(crate) instance: u64,
    pub(crate) nonce: [u8; NONCE_LEN],
}

impl Hello {
    pub(crate) const LEN: usize = 48;

    pub(crate) fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[8..16].copy_from_slice(&self.instance.to_le_bytes());
        b[16..48].copy_from_slice(&self.nonce);
        b
    }

    /// Decodes a hello. Another version is not an error here: the target answers it
    /// with [`Status::Version`].
    ///
    /// # Errors
    /// Truncated input, bad magic, non-zero flags.
    pub(crate) fn decode(b: &[u8]) -> Result<Hello, WireError> {
        need(b, Self::LEN)?;
        magic(b)?;
        if u16_at(b, 6) != 0 {
            return Err(WireError::Field("flags"));
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[16..48]);
        Ok(Hello {
            version: u16_at(b, 4),
            instance: u64_at(b, 8),
            nonce,
        })
    }
}

/// Target → initiator: whether it goes on, whether a token is required, its nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Challenge {
    pub(crate) version: u16,
    pub(crate) status: Status,
    pub(crate) auth: bool,
    pub(crate) nonce: [u8; NONCE_LEN],
}

impl Challenge {
    pub(crate) const LEN: usize = 44;

    pub(crate) fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&(self.status as u16).to_le_bytes());
        b[8] = u8::from(self.auth);
        b[12..44].copy_from_slice(&self.nonce);
        b
    }

    /// # Errors
    /// Truncated input, bad magic, an unknown status, a bad auth flag, non-zero padding.
    pub(crate) fn decode(b: &[u8]) -> Result<Challenge, WireError> {
        need(b, Self::LEN)?;
        magic(b)?;
        let status = Status::from_u16(u16_at(b, 6)).ok_or(WireError::Field("status"))?;
        let auth = match b[8] {
            0 => false,
            1 => true,
            _ => return Err(WireError::Field("auth")),
        };
        if b[9..12] != [0, 0, 0] {
            return Err(WireError::Reserved);
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[12..44]);
        Ok(Challenge {
            version: u16_at(b, 4),
            status,
            auth,
            nonce,
        })
    }
}

/// Target → initiator, after an accepting [`Challenge`]: the target's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Terms {
    /// The longest payload the target accepts in one frame.
    pub(crate) max_payload: u64,
}

impl Terms {
    pub(crate) const LEN: usize = 12;

    pub(crate) fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..12].copy_from_slice(&self.max_payload.to_le_bytes());
        b
    }

    /// # Errors
    /// Truncated input, bad magic, a limit outside `MIN_PAYLOAD..=MAX_PAYLOAD`.
    pub(crate) fn decode(b: &[u8]) -> Result<Terms, WireError> {
        need(b, Self::LEN)?;
        magic(b)?;
        let max_payload = u64_at(b, 4);
        if !(MIN_PAYLOAD..=MAX_PAYLOAD).contains(&max_payload) {
            return Err(WireError::Field("max_payload"));
        }
        Ok(Terms { max_payload })
    }
}

/// Initiator → target: the initiator's MAC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Proof {
    pub(crate) mac: [u8; MAC_LEN],
}

impl Proof {
    pub(crate) const LEN: usize = 36;

    pub(crate) fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..].copy_from_slice(&self.mac);
        b
    }

    /// # Errors
    /// Truncated input, bad magic.
    pub(crate) fn decode(b: &[u8]) -> Result<Proof, WireError> {
        need(b, Self::LEN)?;
        magic(b)?;
        let mut mac = [0u8; MAC_LEN];
        mac.copy_from_slice(&b[4..36]);
        Ok(Proof { mac })
    }
}

/// Target → initiator: accepted or refused, and the target's own MAC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Welcome {
    pub(crate) status: Status,
    pub(crate) mac: [u8; MAC_LEN],
}

impl Welcome {
    pub(crate) const LEN: usize = 40;

    pub(crate) fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&(self.status as u16).to_le_bytes());
        b[8..].copy_from_slice(&self.mac);
        b
    }

    /// # Errors
    /// Truncated input, bad magic, an unknown status, non-zero padding.
    pub(crate) fn decode(b: &[u8]) -> Result<Welcome, WireError> {
        need(b, Self::LEN)?;
        magic(b)?;
        let status = Status::from_u16(u16_at(b, 4)).ok_or(WireError::Field("status"))?;
        if b[6..8] != [0, 0] {
            return Err(WireError::Reserved);
        }
        let mut mac = [0u8; MAC_LEN];
        mac.copy_from_slice(&b[8..40]);
        Ok(Welcome { status, mac })
    }
}

/// The role a proof is made in: the side, the protocol and the target instance, so a
/// proof answers exactly one handshake with one instance.
pub(crate) fn role(side: &str, instance: u64) -> String {
    format!("te-tcp/1 {side} {instance:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_kind() -> impl Strategy<Value = Kind> {
        prop_oneof![
            Just(Kind::Write),
            Just(Kind::Read),
            Just(Kind::WriteAck),
            Just(Kind::ReadData),
            Just(Kind::Error),
            Just(Kind::WriteV),
            Just(Kind::ReadV),
        ]
    }

    /// Valid headers of every kind.
    fn valid_header() -> impl Strategy<Value = Header> {
        (
            any_kind(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            1..=MAX_PAYLOAD,
        )
            .prop_map(|(kind, id, region, offset, len)| match kind {
                Kind::Write | Kind::Read => {
                    Header::request(kind, id, region, offset.min(u64::MAX - len), len)
                }
                Kind::WriteAck => Header::response(kind, 0, id, 0),
                Kind::ReadData => Header::response(kind, 0, id, len),
                Kind::Error => Header::response(kind, 5, id, len.min(MAX_MESSAGE)),
                Kind::WriteV | Kind::ReadV => Header {
                    kind,
                    code: (id % MAX_ENTRIES as u64) as u32 + 1,
                    id,
                    region,
                    offset: 0,
                    len,
                },
            })
    }

    #[test]
    fn every_kind_round_trips() {
        for h in [
            Header::request(Kind::Write, 1, 2, 3, 4),
            Header::request(Kind::Read, u64::MAX, 7, u64::MAX - 1, 1),
            Header::response(Kind::WriteAck, 0, 9, 0),
            Header::response(Kind::ReadData, 0, 9, MAX_PAYLOAD),
            Header::response(Kind::Error, 5, 9, 12),
        ] {
            assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
    }

    #[test]
    fn fields_are_little_endian_at_fixed_offsets() {
        let b = Header::request(Kind::Write, 0x0102, 3, 0x10, 0x20).encode();
        assert_eq!(b[0], 1);
        assert_eq!(&b[8..10], &[0x02, 0x01]);
        assert_eq!(b[16], 3);
        assert_eq!(b[24], 0x10);
        assert_eq!(b[32], 0x20);
    }

    #[test]
    fn malformed_headers_are_refused_with_the_reason() {
        let ok = Header::request(Kind::Write, 1, 2, 3, 4).encode();
        type Mutation = fn(&mut [u8; HEADER_LEN]);
        let cases: Vec<(Mutation, &str)> = vec![
            (|b| b[0] = 0, "unknown frame kind 0"),
            (|b| b[0] = 9, "unknown frame kind 9"),
            (|b| b[2] = 1, "reserved"),
            (|b| b[4] = 1, "`code`"),
            (|b| b[32..40].fill(0), "outside 1..="),
            (
                |b| b[32..40].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes()),
                "outside 1..=",
            ),
            (
                |b| b[24..32].copy_from_slice(&u64::MAX.to_le_bytes()),
                "overflows",
            ),
        ];
        for (mutate, want) in cases {
            let mut b = ok;
            mutate(&mut b);
            let e = Header::decode(&b).unwrap_err().to_string();
            assert!(e.contains(want), "{e} lacks {want}");
        }
        let ack = Header::response(Kind::WriteAck, 0, 1, 0).encode();
        let mut b = ack;
        b[16] = 1;
        assert!(Header::decode(&b).is_err(), "a response naming a region");
        let mut b = ack;
        b[32] = 1;
        assert!(Header::decode(&b).is_err(), "an ack with a length");
        let mut b = Header::response(Kind::Error, 5, 1, 10).encode();
        b[4..8].fill(0);
        assert_eq!(Header::decode(&b), Err(WireError::NoCode));
        assert!(matches!(
            Header::decode(&ok[..39]),
            Err(WireError::Truncated { got: 39, .. })
        ));
    }

    fn sg(kind: Kind, entries: &[(u64, u64)], len: u64) -> (Header, Vec<u8>) {
        let h = Header {
            kind,
            code: entries.len() as u32,
            id: 1,
            region: 2,
            offset: 0,
            len,
        };
        let mut b = h.encode().to_vec();
        for &(offset, len) in entries {
            Entry { offset, len }.encode_into(&mut b);
        }
        (h, b)
    }

    #[test]
    fn scatter_gather_frames_round_trip_and_their_entries_are_checked() {
        let (h, b) = sg(Kind::WriteV, &[(0, 10), (100, 6)], 16);
        assert_eq!(Header::decode(&b), Ok(h));
        let mut v = Vec::new();
        decode_entries(&h, &b[HEADER_LEN..], &mut v).unwrap();
        assert_eq!(
            v,
            [
                Entry { offset: 0, len: 10 },
                Entry {
                    offset: 100,
                    len: 6
                }
            ]
        );
        // The header lies about the payload: the entries add up to another length.
        let (h, b) = sg(Kind::ReadV, &[(0, 10), (100, 6)], 17);
        let e = decode_entries(&h, &b[HEADER_LEN..], &mut v).unwrap_err();
        assert_eq!(e, WireError::EntrySum { sum: 16, len: 17 });
        let (h, b) = sg(Kind::WriteV, &[(0, 10), (5, 0)], 10);
        assert!(matches!(
            decode_entries(&h, &b[HEADER_LEN..], &mut v),
            Err(WireError::BadEntry { index: 1, .. })
        ));
        let (h, b) = sg(Kind::WriteV, &[(u64::MAX, 2)], 2);
        assert!(matches!(
            decode_entries(&h, &b[HEADER_LEN..], &mut v),
            Err(WireError::BadEntry { index: 0, .. })
        ));
        assert!(matches!(
            decode_entries(&h, &b[HEADER_LEN..HEADER_LEN + 8], &mut v),
            Err(WireError::Truncated { .. })
        ));
        // Too many entries, none, or a non-zero offset are refused by the header alone.
        let mut big = h;
        big.code = MAX_ENTRIES as u32 + 1;
        let e = Header::decode(&big.encode()).unwrap_err();
        assert_eq!(e, WireError::Entries(MAX_ENTRIES as u32 + 1));
        assert!(e.to_string().contains("outside 1..=1024"), "{e}");
        big.code = 0;
        assert_eq!(Header::decode(&big.encode()), Err(WireError::Entries(0)));
        let mut off = h;
        off.offset = 1;
        assert!(Header::decode(&off.encode()).is_err());
        let mut long = h;
        long.len = MAX_PAYLOAD + 1;
        assert!(Header::decode(&long.encode()).is_err());
    }

    #[test]
    fn handshake_messages_round_trip_and_refuse_garbage() {
        let hello = Hello {
            version: VERSION,
            instance: 42,
            nonce: [7; 32],
        };
        assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
        let ch = Challenge {
            version: VERSION,
            status: Status::WrongInstance,
            auth: true,
            nonce: [1; 32],
        };
        assert_eq!(Challenge::decode(&ch.encode()), Ok(ch));
        let p = Proof { mac: [3; 32] };
        assert_eq!(Proof::decode(&p.encode()), Ok(p));
        let t = Terms { max_payload: 65536 };
        assert_eq!(Terms::decode(&t.encode()), Ok(t));
        for bad in [0, MIN_PAYLOAD - 1, MAX_PAYLOAD + 1] {
            let b = Terms { max_payload: bad }.encode();
            assert_eq!(Terms::decode(&b), Err(WireError::Field("max_payload")));
        }
        let w = Welcome {
            status: Status::AuthFailed,
            mac: [4; 32],
        };
        assert_eq!(Welcome::decode(&w.encode()), Ok(w));
        let mut b = hello.encode();
        b[0] = b'X';
        assert!(matches!(Hello::decode(&b), Err(WireError::Magic(_))));
        let mut b = ch.encode();
        b[6] = 77;
        assert_eq!(Challenge::decode(&b), Err(WireError::Field("status")));
        let mut b = ch.encode();
        b[8] = 2;
        assert_eq!(Challenge::decode(&b), Err(WireError::Field("auth")));
        assert!(Welcome::decode(&w.encode()[..10]).is_err());
    }

    /// Decodes `b` with every decoder; none may panic, and whatever a decoder accepts
    /// must encode back to the same bytes (nothing is silently ignored).
    fn decode_everything(b: &[u8]) {
        if let Ok(h) = Header::decode(b) {
            assert_eq!(&h.encode()[..], &b[..HEADER_LEN]);
            match h.kind {
                Kind::Write | Kind::Read => {
                    assert!(h.len >= 1 && h.len <= MAX_PAYLOAD);
                    assert!(h.offset.checked_add(h.len).is_some());
                }
                Kind::Error => assert!(h.code != 0 && h.len <= MAX_MESSAGE),
                Kind::WriteV | Kind::ReadV => {
                    assert!(h.entries() >= 1 && h.entries() <= MAX_ENTRIES);
                    assert!(h.len >= 1 && h.len <= MAX_PAYLOAD && h.offset == 0);
                    let mut v = Vec::new();
                    if decode_entries(&h, &b[HEADER_LEN..], &mut v).is_ok() {
                        assert_eq!(v.iter().map(|e| e.len).sum::<u64>(), h.len);
                        assert!(v
                            .iter()
                            .all(|e| e.len > 0 && e.offset.checked_add(e.len).is_some()));
                    }
                }
                _ => assert!(h.region == 0 && h.offset == 0),
            }
        }
        if let Ok(m) = Hello::decode(b) {
            assert_eq!(&m.encode()[..], &b[..Hello::LEN]);
        }
        if let Ok(m) = Challenge::decode(b) {
            assert_eq!(&m.encode()[..], &b[..Challenge::LEN]);
        }
        if let Ok(m) = Proof::decode(b) {
            assert_eq!(&m.encode()[..], &b[..Proof::LEN]);
        }
        if let Ok(m) = Terms::decode(b) {
            assert_eq!(&m.encode()[..], &b[..Terms::LEN]);
        }
        if let Ok(m) = Welcome::decode(b) {
            assert_eq!(&m.encode()[..], &b[..Welcome::LEN]);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 60_000, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn random_bytes_never_panic_the_decoders(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            decode_everything(&b);
        }

        #[test]
        fn mutated_valid_frames_decode_or_are_refused(
            h in valid_header(),
            flips in proptest::collection::vec((0..HEADER_LEN, any::<u8>()), 1..4),
        ) {
            let good = h.encode();
            prop_assert_eq!(Header::decode(&good), Ok(h));
            let mut b = good;
            for (at, x) in flips {
                b[at] ^= x;
            }
            decode_everything(&b);
        }
    }
}
