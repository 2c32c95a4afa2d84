//! Proof of a shared `auth_token`: HMAC-SHA-256 over both sides' fresh nonces, so the
//! token never travels and a recorded exchange cannot be replayed against new nonces.
//! The engine's control plane and every backend's side traffic use it.
//!
//! Each side proves itself with a MAC over a label naming its role and both nonces, its
//! own first; so a proof cannot be reflected back at its sender.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce and of a proof.
pub const LEN: usize = 32;

/// A fresh random nonce.
pub fn nonce() -> [u8; LEN] {
    rand::random()
}

/// The proof that the holder of `token` speaks as `role` in the exchange of `mine` and
/// `theirs` (in that order from the prover's side).
pub fn prove(token: &[u8], role: &str, mine: &[u8], theirs: &[u8]) -> [u8; LEN] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(token).expect("HMAC takes any key length");
    for part in [role.as_bytes(), mine, theirs] {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

/// Checks, in constant time, a proof made by [`prove`] with the same arguments (the
/// prover's nonce first).
pub fn verify(token: &[u8], role: &str, mine: &[u8], theirs: &[u8], proof: &[u8]) -> bool {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(token).expect("HMAC takes any key length");
    for part in [role.as_bytes(), mine, theirs] {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac.verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_verifies_only_with_the_same_token_role_and_nonces() {
        let (a, b) = (nonce(), nonce());
        let p = prove(b"secret", "client", &a, &b);
        assert!(verify(b"secret", "client", &a, &b, &p));
        assert!(!verify(b"other", "client", &a, &b, &p));
        assert!(!verify(b"secret", "server", &a, &b, &p));
        assert!(!verify(b"secret", "client", &b, &a, &p));
        assert!(!verify(b"secret", "client", &a, &b, &p[..31]));
    }

    #[test]
    fn the_mac_is_rfc_4231_hmac_sha256() {
        // RFC 4231 test case 2, through the same primitive.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        let out: [u8; 32] = mac.finalize().into_bytes().into();
        assert_eq!(
            out[..4],
            [0x5b, 0xdc, 0xc1, 0x46],
            "HMAC-SHA-256 of the RFC's second test"
        );
    }
}
