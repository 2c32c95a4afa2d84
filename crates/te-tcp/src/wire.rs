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
mod tests;
