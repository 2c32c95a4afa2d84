//! What `include/te.h` takes from Rust: the status codes (from te's one `ErrorKind`
//! table) and the ABI version. The header is written by hand except for one block,
//! which a test regenerates and compares, so the two cannot drift.

use te_facade::ErrorKind;

/// The version of the C ABI; `te_abi_version()` returns it, and te.h's
/// `TE_ABI_VERSION` must equal it. Raised on any incompatible change to te.h.
pub const ABI_VERSION: u32 = 1;

/// Every kind in te's `ErrorKind` table, in code order. The table has no list of its
/// own; a code names a kind when the kind it maps to has that code.
pub(crate) fn kinds() -> Vec<ErrorKind> {
    (1..=255)
        .map(ErrorKind::from_code)
        .enumerate()
        .filter(|(i, kind)| kind.code() as usize == i + 1)
        .map(|(_, kind)| kind)
        .collect()
}

/// `ConfigInvalid` → `CONFIG_INVALID`.
#[cfg(test)]
fn screaming(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    const BEGIN: &str =
        "/* BEGIN GENERATED (cargo test -p te-capi checks it; TE_BLESS=1 rewrites it) */";
    const END: &str = "/* END GENERATED */";

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// The doc comment of each kind, read from the `error_kinds!` table in te-core.
    fn docs() -> Vec<(String, u32, String)> {
        let source = std::fs::read_to_string(root().join("crates/te-core/src/error.rs"))
            .expect("read te-core's error.rs");
        let table = source
            .split("error_kinds! {")
            .nth(1)
            .expect("te-core's error.rs invokes error_kinds!");
        let mut doc = String::new();
        let mut out = Vec::new();
        for line in table.lines().map(str::trim) {
            if line == "}" {
                break;
            }
            if let Some(d) = line.strip_prefix("///") {
                doc.push_str(d.trim());
                doc.push(' ');
            } else if let Some((name, code)) = line.trim_end_matches(',').split_once(" = ") {
                let code = code.parse().expect("a kind's code is a number");
                out.push((name.to_string(), code, std::mem::take(&mut doc)));
            }
        }
        out
    }

    fn generated() -> String {
        let mut out = format!("{BEGIN}\n");
        out.push_str(&format!(
            "/** The version of the C ABI this header describes; `te_abi_version()` returns\n    the library's. */\n#define TE_ABI_VERSION {ABI_VERSION}u\n\n"
        ));
        out.push_str(
            "/** What a te call returns: `TE_OK`, `TE_PENDING` (not an error), or minus the code\n    of an error kind in te's `ErrorKind` table. */\ntypedef enum te_status {\n",
        );
        out.push_str("    /** Success. */\n    TE_OK = 0,\n");
        out.push_str("    /** Not yet: a batch still in flight, nothing received in time. */\n    TE_PENDING = 1,\n");
        for (name, code, doc) in docs() {
            out.push_str(&format!(
                "    /** {} */\n    TE_ERR_{} = -{code},\n",
                doc.trim(),
                screaming(&name)
            ));
        }
        out.push_str("} te_status;\n");
        out.push_str(END);
        out
    }

    #[test]
    fn the_header_lists_every_error_kind_with_its_code() {
        let docs = docs();
        let kinds = kinds();
        assert_eq!(
            docs.len(),
            kinds.len(),
            "te-core's table and ErrorKind differ"
        );
        for ((name, code, _), kind) in docs.iter().zip(&kinds) {
            assert_eq!((name.as_str(), *code), (kind.as_str(), kind.code()));
        }
        let path = root().join("include/te.h");
        let header = std::fs::read_to_string(&path).expect("read include/te.h");
        let start = header
            .find(BEGIN)
            .expect("te.h has the BEGIN GENERATED line");
        let end = header.find(END).expect("te.h has the END GENERATED line") + END.len();
        let current = &header[start..end];
        let wanted = generated();
        if current == wanted {
            return;
        }
        if std::env::var_os("TE_BLESS").is_some() {
            let blessed = format!("{}{wanted}{}", &header[..start], &header[end..]);
            std::fs::write(&path, blessed).expect("write include/te.h");
            return;
        }
        panic!(
            "include/te.h's generated block is out of date; run `TE_BLESS=1 cargo test -p te-capi`.\nwanted:\n{wanted}\nfound:\n{current}"
        );
    }

    #[test]
    fn c_structs_have_the_sizes_te_h_asserts() {
        // tests/capi/te_test.c asserts the same sizes from the C side.
        assert_eq!(std::mem::size_of::<crate::TeRequest>(), 48);
        assert_eq!(std::mem::size_of::<crate::TePeerEvent>(), 536);
    }

    #[test]
    fn status_names_follow_the_table() {
        use std::ffi::CStr;
        for kind in kinds() {
            // SAFETY: te_status_name returns a static NUL-terminated string.
            let name = unsafe {
                CStr::from_ptr(crate::error::te_status_name(crate::error::status_of(kind)))
            };
            assert_eq!(name.to_str().unwrap(), kind.as_str());
        }
        // SAFETY: as above.
        let unknown = unsafe { CStr::from_ptr(crate::error::te_status_name(-1000)) };
        assert_eq!(unknown.to_str().unwrap(), "Unknown");
    }
}
