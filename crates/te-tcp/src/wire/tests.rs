//! Tests of the wire format: every frame and handshake message round-trips, fields sit
//! at their fixed offsets, and malformed bytes are refused with the reason, never a
//! panic.

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
