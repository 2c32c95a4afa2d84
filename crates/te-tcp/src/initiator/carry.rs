//! The bytes of frames on their way out of one data connection: each frame's header
//! (and entry list) and its payload spans, in wire order, and how much of them the
//! socket has taken, so that a `sendmsg` that stops part way resumes where it stopped.

use crate::sock;

/// Frames being written: their header bytes (with a scatter-gather frame's entry list)
/// and payload spans, in wire order, and how much of them is already out.
#[derive(Default)]
pub(crate) struct Carry {
    /// The frames' header bytes, one after another.
    head: Vec<u8>,
    /// What goes on the wire, in order.
    segs: Vec<Seg>,
    /// The first span not wholly written, and the bytes of it that are.
    at: usize,
    skip: usize,
}

/// One span of [`Carry`]: a range of its header bytes, or a payload in memory.
#[derive(Clone, Copy)]
enum Seg {
    Head { start: usize, len: usize },
    Payload { addr: usize, len: usize },
}

impl Seg {
    fn len(&self) -> usize {
        match *self {
            Seg::Head { len, .. } | Seg::Payload { len, .. } => len,
        }
    }
}

impl Carry {
    /// Whether every span is written (or none was pushed).
    pub(crate) fn is_empty(&self) -> bool {
        self.at == self.segs.len()
    }

    /// Forgets everything, keeping the buffers.
    pub(crate) fn clear(&mut self) {
        self.head.clear();
        self.segs.clear();
        self.at = 0;
        self.skip = 0;
    }

    /// How many spans were pushed since the last `clear`, written ones included.
    pub(crate) fn spans(&self) -> usize {
        self.segs.len()
    }

    /// Adds a frame: its header bytes, then its payload spans.
    pub(crate) fn push(&mut self, head: &[u8], payloads: impl Iterator<Item = (usize, usize)>) {
        let start = self.head.len();
        self.head.extend_from_slice(head);
        self.segs.push(Seg::Head {
            start,
            len: head.len(),
        });
        self.segs.extend(
            payloads
                .filter(|p| p.1 > 0)
                .map(|(addr, len)| Seg::Payload { addr, len }),
        );
    }

    /// Marks `n` more bytes written.
    pub(crate) fn advance(&mut self, n: usize) {
        let mut left = self.skip + n;
        while self.at < self.segs.len() {
            let len = self.segs[self.at].len();
            if left < len {
                break;
            }
            left -= len;
            self.at += 1;
        }
        self.skip = left;
    }

    /// Fills `v` with the spans still to write (as many as fit); returns how many.
    pub(crate) fn iovecs(&self, v: &mut [libc::iovec]) -> usize {
        let mut n = 0;
        for (i, seg) in self.segs[self.at..].iter().take(v.len()).enumerate() {
            let (ptr, len) = match *seg {
                // `start + len` lies inside `head`, built by `push`.
                Seg::Head { start, len } => (self.head[start..start + len].as_ptr(), len),
                Seg::Payload { addr, len } => (addr as *const u8, len),
            };
            v[i] = if i == 0 {
                // Skip what an earlier call already sent of the first span; `skip < len`
                // (a wholly sent span is passed by `advance`).
                sock::iov(ptr.wrapping_add(self.skip), len - self.skip)
            } else {
                sock::iov(ptr, len)
            };
            n += 1;
        }
        n
    }
}
