//! The control plane's frames.
//!
//! A frame is a 16-byte header — `b"TE"`, the frame format `2`, a message kind, the
//! payload length (`u32`, little-endian), a request id (`u64`, little-endian) — then the
//! payload. Each kind has its own size limit, checked against the header before any of
//! the payload is read: a request is small, only some answers (a descriptor) are large.
//! Replies carry their request's id, so many requests are in flight on one connection.
//!
//! Payloads are CBOR maps (self-describing): a field added in a later protocol version
//! is ignored by an engine that does not know it, and one missing from an earlier
//! version takes its default. The protocol version itself is agreed in the handshake
//! (the highest both sides speak); the compatibility policy is in `docs/decisions.md`.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

/// The frame magic.
pub(crate) const MAGIC: [u8; 2] = *b"TE";
/// The frame format (the header's layout); the protocol version is agreed separately.
pub(crate) const FRAME: u8 = 2;
/// Header bytes.
pub(crate) const HEADER: usize = 16;
/// The largest payload of any kind (a descriptor).
pub const MAX_FRAME: usize = 64 << 20;

/// The protocol versions this build speaks, oldest first.
///
/// Version 3 changed only the handshake with an `auth_token`: the client proves the
/// token first and the server's proof comes in `Ready`, once the client's was checked.
/// Without a token the two versions are the same on the wire, so an engine without one
/// still talks to version 2; an engine with one refuses it.
pub const VERSIONS: (u16, u16) = (2, 3);
/// The first version in which the client proves the token first; an engine with an
/// `auth_token` speaks no older one.
pub(crate) const CLIENT_PROVES_FIRST: u16 = 3;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    /// Client → server, first frame: versions, identity, nonce.
    Hello = 1,
    /// Server → client: the agreed version, its nonce, and whether it asks for a proof.
    Welcome = 2,
    /// Client → server: the client's proof.
    Proof = 3,
    /// Server → client: authenticated; the server's identity, and its proof.
    Ready = 4,
    /// Either way: a refusal or a failed request.
    Error = 5,
    /// Request: the segment descriptor.
    GetSegment = 6,
    /// Reply: the segment descriptor.
    Segment = 7,
    /// Request: a notification.
    Notify = 8,
    /// Reply: accepted.
    Ack = 9,
    /// Either way: are you there?
    Ping = 10,
    /// Either way: yes.
    Pong = 11,
    /// Request: a message for the engine's backend.
    Backend = 12,
    /// Reply: the backend's answer.
    BackendReply = 13,
    /// Either way: closing on purpose.
    Bye = 14,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Hello,
            2 => Welcome,
            3 => Proof,
            4 => Ready,
            5 => Error,
            6 => GetSegment,
            7 => Segment,
            8 => Notify,
            9 => Ack,
            10 => Ping,
            11 => Pong,
            12 => Backend,
            13 => BackendReply,
            14 => Bye,
            _ => return None,
        })
    }

    /// The largest payload a frame of this kind may carry, given the receiver's
    /// notification limit.
    pub(crate) const fn limit(self, notification_max: usize) -> usize {
        use Kind::*;
        match self {
            Hello | Welcome | Proof => 4 << 10,
            Ready | Error => 64 << 10,
            GetSegment | Ack | Ping | Pong | Bye => 256,
            Notify => notification_max + (4 << 10),
            Backend => 1 << 20,
            Segment | BackendReply => MAX_FRAME,
        }
    }
}

/// A frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) len: usize,
    pub(crate) id: u64,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[..2].copy_from_slice(&MAGIC);
        h[2] = FRAME;
        h[3] = self.kind as u8;
        h[4..8].copy_from_slice(&(self.len as u32).to_le_bytes());
        h[8..].copy_from_slice(&self.id.to_le_bytes());
        h
    }

    /// Checks a header: magic, format, a known kind, and a length within that kind's
    /// limit.
    pub(crate) fn decode(h: &[u8; HEADER], notification_max: usize) -> Result<Header> {
        let bad = |m: String| Err(Error::new(ErrorKind::Protocol, m).with_operation("read frame"));
        if h[..2] != MAGIC {
            return bad(format!(
                "bad magic {:02x}{:02x}: not a te control-plane peer",
                h[0], h[1]
            ));
        }
        if h[2] != FRAME {
            return bad(format!(
                "frame format {} is not {FRAME}: the peer runs a te too old or too new to talk to this one",
                h[2]
            ));
        }
        let Some(kind) = Kind::from_u8(h[3]) else {
            return bad(format!("unknown message kind {}", h[3]));
        };
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let limit = kind.limit(notification_max);
        if len > limit {
            return bad(format!(
                "a {kind:?} frame of {len} bytes exceeds its {limit}-byte limit"
            ));
        }
        let id = u64::from_le_bytes(h[8..].try_into().unwrap_or_default());
        Ok(Header { kind, len, id })
    }
}

/// A whole frame: header and payload.
pub(crate) fn frame(kind: Kind, id: u64, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER + payload.len());
    f.extend_from_slice(
        &Header {
            kind,
            len: payload.len(),
            id,
        }
        .encode(),
    );
    f.extend_from_slice(payload);
    f
}

/// Encodes a payload.
pub(crate) fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = Vec::new();
    ciborium::into_writer(value, &mut out).expect("encoding into a Vec cannot fail");
    out
}

/// Decodes a payload.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    ciborium::from_reader(bytes).map_err(|e| {
        use ciborium::de::Error as De;
        let why = match e {
            De::Semantic(_, m) => m,
            De::Syntax(at) => format!("not valid CBOR at byte {at}"),
            De::Io(e) => format!("cut short ({e:?})"),
            De::RecursionLimitExceeded => "nested too deeply".into(),
        };
        Error::new(ErrorKind::Protocol, format!("{what} is malformed: {why}"))
            .with_operation("read frame")
    })
}

/// The client's first frame.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Hello {
    /// The protocol versions the client speaks, oldest and newest.
    pub(crate) versions: (u16, u16),
    /// The client's nonce.
    #[serde(with = "bytes")]
    pub(crate) nonce: Vec<u8>,
    /// The client's engine name, epoch and control-plane address (told to the server
    /// only once it is authenticated: it is trusted only then).
    pub(crate) name: String,
    pub(crate) epoch: u64,
    pub(crate) address: String,
    /// How often the client sends a heartbeat, in milliseconds.
    pub(crate) heartbeat_ms: u64,
}

/// The server's answer to `Hello`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Welcome {
    /// The agreed protocol version.
    pub(crate) version: u16,
    #[serde(with = "bytes")]
    pub(crate) nonce: Vec<u8>,
    /// The server has a token: the client must prove it, before the server proves it
    /// back in `Ready`.
    #[serde(default)]
    pub(crate) auth: bool,
    /// Version 2 only: the server's proof, sent before the client proved anything (so
    /// anyone could collect one and guess the token offline). A client reads it only
    /// to tell that such a server wants a token; this build never sends it.
    #[serde(default, with = "opt_bytes")]
    pub(crate) proof: Option<Vec<u8>>,
}

/// The client's proof.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Proof {
    #[serde(with = "bytes")]
    pub(crate) proof: Vec<u8>,
}

/// Who an engine is, as the other side of a session learned it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Identity {
    pub(crate) name: String,
    pub(crate) epoch: u64,
    pub(crate) address: String,
    pub(crate) heartbeat_ms: u64,
    /// The largest notification this engine accepts, in bytes, announced in `Ready`
    /// so a sender refuses a larger one itself instead of sending it (absent from an
    /// engine that does not announce it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) notification_max: Option<u64>,
}

/// The server's last handshake frame: who it is, and where it has a token its proof,
/// made only after it checked the client's.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Ready {
    #[serde(flatten)]
    pub(crate) identity: Identity,
    #[serde(default, skip_serializing_if = "Option::is_none", with = "opt_bytes")]
    pub(crate) proof: Option<Vec<u8>>,
}

/// A notification as it travels: the receiver's expected epoch and the message. The
/// sender is the session's authenticated identity, not a field anyone can write.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Notice {
    pub(crate) to_epoch: u64,
    #[serde(with = "bytes")]
    pub(crate) message: Vec<u8>,
}

/// A message for the receiving engine's backend, with the sender's deadline.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct BackendMsg {
    pub(crate) timeout_ms: u64,
    #[serde(with = "bytes")]
    pub(crate) payload: Vec<u8>,
}

/// An error as it travels.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WireError {
    pub(crate) code: u32,
    pub(crate) message: String,
}

impl WireError {
    pub(crate) fn from_error(e: &Error) -> WireError {
        WireError {
            code: e.kind().code(),
            message: e.to_string(),
        }
    }

    pub(crate) fn into_error(self) -> Error {
        Error::from_peer(ErrorKind::from_code(self.code), "", &self.message).with_operation("peer")
    }
}

/// The encoded payload of an error frame.
pub(crate) fn error_payload(e: &Error) -> Vec<u8> {
    encode(&WireError::from_error(e))
}

/// Byte strings as CBOR byte strings, not arrays of numbers.
mod bytes {
    use serde::{Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            // ciborium hands byte strings longer than its scratch buffer over as a
            // sequence of bytes.
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Vec<u8>, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
                while let Some(b) = seq.next_element::<u8>()? {
                    v.push(b);
                }
                Ok(v)
            }
        }
        d.deserialize_byte_buf(V)
    }
}

mod opt_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_some(&serde_bytes_ref(b)),
            None => s.serialize_none(),
        }
    }

    struct Bytes<'a>(&'a [u8]);
    impl serde::Serialize for Bytes<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }
    fn serde_bytes_ref(b: &[u8]) -> Bytes<'_> {
        Bytes(b)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        #[derive(Deserialize)]
        struct W(#[serde(with = "super::bytes")] Vec<u8>);
        Ok(Option::<W>::deserialize(d)?.map(|w| w.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_payload_says_why_in_words() {
        #[derive(Debug, Deserialize)]
        struct Wants {
            _n: u32,
        }
        let cases: [(&[u8], &str); 3] = [
            (&encode(&"text"), "invalid type"),
            (&[0xa1, 0x1c], "not valid CBOR at byte 1"),
            (&[0xa1], "cut short"),
        ];
        for (bytes, want) in cases {
            let e = decode::<Wants>(bytes, "the payload").unwrap_err();
            let text = e.to_string();
            assert_eq!(e.kind(), ErrorKind::Protocol);
            assert!(text.contains(want), "{text}");
            assert!(
                !text.contains("Semantic(") && !text.contains("Syntax("),
                "{text}"
            );
        }
    }

    #[test]
    fn headers_round_trip_and_are_checked_per_kind() {
        let h = Header {
            kind: Kind::Notify,
            len: 100,
            id: 7,
        };
        assert_eq!(Header::decode(&h.encode(), 64 << 10).unwrap(), h);
        let big = Header {
            kind: Kind::GetSegment,
            len: 1 << 20,
            id: 1,
        };
        let e = Header::decode(&big.encode(), 64 << 10).unwrap_err();
        assert!(e.to_string().contains("limit"), "{e}");
        let mut bad = h.encode();
        bad[0] = b'X';
        assert_eq!(
            Header::decode(&bad, 0).unwrap_err().kind(),
            ErrorKind::Protocol
        );
        let mut old = h.encode();
        old[2] = 1;
        assert!(Header::decode(&old, 1 << 20)
            .unwrap_err()
            .to_string()
            .contains("format 1"));
        let mut unknown = h.encode();
        unknown[3] = 200;
        assert!(Header::decode(&unknown, 1 << 20).is_err());
    }

    #[test]
    fn byte_strings_of_any_size_round_trip() {
        for len in [0, 1, 4095, 4096, 4097, 64 << 10, 1 << 20] {
            let message: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let n: Notice = decode(
                &encode(&Notice {
                    to_epoch: 7,
                    message: message.clone(),
                }),
                "notice",
            )
            .unwrap();
            assert_eq!((n.to_epoch, n.message.len()), (7, len));
            assert!(n.message == message, "{len} bytes changed on the way");
            let m: BackendMsg = decode(
                &encode(&BackendMsg {
                    timeout_ms: 1,
                    payload: message.clone(),
                }),
                "backend message",
            )
            .unwrap();
            assert!(m.payload == message, "{len} bytes changed on the way");
        }
    }

    #[test]
    fn payloads_ignore_fields_they_do_not_know_and_default_missing_ones() {
        #[derive(Serialize)]
        struct NewerWelcome {
            version: u16,
            #[serde(with = "bytes")]
            nonce: Vec<u8>,
            compression: &'static str,
        }
        let w: Welcome = decode(
            &encode(&NewerWelcome {
                version: 3,
                nonce: vec![1, 2],
                compression: "zstd",
            }),
            "welcome",
        )
        .unwrap();
        assert_eq!(
            (w.version, w.nonce, w.auth, w.proof),
            (3, vec![1, 2], false, None)
        );
    }

    #[test]
    fn ready_carries_the_identity_and_an_optional_proof() {
        let identity = Identity {
            name: "decode-0".into(),
            epoch: 7,
            address: "127.0.0.1:9".into(),
            heartbeat_ms: 1000,
            notification_max: Some(4096),
        };
        for proof in [None, Some(vec![9u8; 32])] {
            let r: Ready = decode(
                &encode(&Ready {
                    identity: identity.clone(),
                    proof: proof.clone(),
                }),
                "ready",
            )
            .unwrap();
            assert_eq!((r.identity, r.proof), (identity.clone(), proof));
        }
        // A version-2 ready is the identity alone.
        let r: Ready = decode(&encode(&identity), "ready").unwrap();
        assert_eq!((r.identity, r.proof), (identity, None));
    }

    proptest::proptest! {
        #[test]
        fn decoding_random_payloads_never_panics(payload in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = decode::<Hello>(&payload, "hello");
            let _ = decode::<Notice>(&payload, "notice");
            let _ = decode::<crate::SegmentDesc>(&payload, "segment");
        }
    }
}
