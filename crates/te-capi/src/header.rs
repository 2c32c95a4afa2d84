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

    /// `text` from `start` up to the parenthesis that closes the one at `start`.
    fn balanced(text: &str, start: usize) -> &str {
        let mut depth = 0;
        for (i, c) in text[start..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        return &text[start + 1..start + i];
                    }
                }
                _ => {}
            }
        }
        panic!("unbalanced parentheses at {}", &text[start..]);
    }

    /// Splits a parameter list at its top-level commas.
    fn params(list: &str) -> Vec<String> {
        let (mut out, mut depth, mut cur) = (Vec::new(), 0, String::new());
        for c in list.chars() {
            match c {
                '(' | '<' => depth += 1,
                ')' | '>' => depth -= 1,
                ',' if depth == 0 => {
                    out.push(std::mem::take(&mut cur));
                    continue;
                }
                _ => {}
            }
            cur.push(c);
        }
        out.push(cur);
        out.into_iter()
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|p| !p.is_empty() && p != "void")
            .collect()
    }

    /// A Rust FFI type as te.h spells it: `*mut *const c_char` → `const char **`.
    fn c_type(rust: &str) -> String {
        let rust = rust.trim();
        if let Some(f) = rust
            .strip_prefix("Option<extern \"C\" fn")
            .and_then(|r| r.strip_suffix('>'))
        {
            let args: Vec<String> = params(balanced(f, f.find('(').unwrap()))
                .iter()
                .map(|p| c_type(p.split_once(':').map_or(p.as_str(), |(_, t)| t)))
                .collect();
            let ret = f
                .rsplit_once("->")
                .map_or("void".into(), |(_, r)| c_type(r));
            return format!("{ret} (*)({})", args.join(", "));
        }
        let (mut rest, mut stars, mut innermost_const) = (rust, 0, false);
        loop {
            if let Some(r) = rest.strip_prefix("*const ") {
                (rest, innermost_const) = (r, true);
            } else if let Some(r) = rest.strip_prefix("*mut ") {
                (rest, innermost_const) = (r, false);
            } else {
                break;
            }
            stars += 1;
        }
        let base = match rest {
            "c_char" => "char",
            "c_int" => "int",
            "c_void" => "void",
            "u8" => "uint8_t",
            "u32" => "uint32_t",
            "u64" => "uint64_t",
            "i64" => "int64_t",
            "usize" => "size_t",
            "TeEngine" => "te_engine",
            "TePeer" => "te_peer",
            "TeBatch" => "te_batch",
            "TeNotification" => "te_notification",
            "TeRequest" => "te_request",
            "TePeerEvent" => "te_peer_event",
            other => panic!("no C spelling for the Rust type `{other}`; add it here"),
        };
        let konst = if innermost_const { "const " } else { "" };
        match stars {
            0 => base.to_string(),
            n => format!("{konst}{base} {}", "*".repeat(n)),
        }
    }

    /// A te.h parameter without its name: `const char *name` → `const char *`,
    /// `void (*callback)(void *user, int status)` → `void (*)(void *, int)`.
    fn c_param(param: &str) -> String {
        if let Some(open) = param.find("(*") {
            let ret = param[..open].trim();
            let args = param[open..]
                .split_once(")(")
                .expect("a function pointer")
                .1;
            let args: Vec<String> = params(args.trim_end_matches(')'))
                .iter()
                .map(|a| c_param(a))
                .collect();
            return format!("{ret} (*)({})", args.join(", "));
        }
        let stars = param.matches('*').count();
        let words: Vec<&str> = param
            .split(|c: char| c == '*' || c.is_whitespace())
            .filter(|w| !w.is_empty())
            .collect();
        // The last word is the name, unless the parameter has none.
        let kept = if words.len() > 1 && words.last() != Some(&"char") {
            &words[..words.len() - 1]
        } else {
            &words[..]
        };
        match stars {
            0 => kept.join(" "),
            n => format!("{} {}", kept.join(" "), "*".repeat(n)),
        }
    }

    type Signature = (String, Vec<String>);

    /// Every exported C function of this crate: name → (return type, parameter types).
    fn rust_signatures() -> std::collections::BTreeMap<String, Signature> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut out = std::collections::BTreeMap::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let source = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            for (at, _) in source.match_indices("extern \"C\" fn te_") {
                let decl = &source[at + "extern \"C\" fn ".len()..];
                let open = decl.find('(').unwrap();
                let name = decl[..open].to_string();
                let list = balanced(decl, open);
                let after = &decl[open + list.len() + 2..decl.find('{').unwrap()];
                let ret = after
                    .trim()
                    .strip_prefix("->")
                    .map_or("void".into(), c_type);
                let types = params(list)
                    .iter()
                    .map(|p| {
                        c_type(
                            p.split_once(':')
                                .unwrap_or_else(|| panic!("{name}: {p:?} has no name"))
                                .1,
                        )
                    })
                    .collect();
                out.insert(name, (ret, types));
            }
        }
        out
    }

    /// Every function te.h declares: name → (return type, parameter types).
    fn header_signatures() -> std::collections::BTreeMap<String, Signature> {
        let header = std::fs::read_to_string(root().join("include/te.h")).unwrap();
        let mut out = std::collections::BTreeMap::new();
        let mut decl = String::new();
        for line in header.lines() {
            // A declaration starts at column 0 with its return type (comments start with
            // `/` or ` `, and no typedef names a function).
            let starts = line.starts_with(|c: char| c.is_ascii_lowercase())
                && !line.starts_with("typedef")
                && line.contains("te_")
                && line.contains('(');
            if decl.is_empty() && !starts {
                continue;
            }
            decl.push_str(line);
            decl.push(' ');
            if !line.trim_end().ends_with(");") {
                continue;
            }
            let open = decl.find('(').unwrap();
            let head = decl[..open].trim();
            let split = head.rfind([' ', '*']).unwrap() + 1;
            let ret = c_param(&format!("{} x", head[..split].trim()));
            let types = params(balanced(&decl, open))
                .iter()
                .map(|p| c_param(p))
                .collect();
            out.insert(head[split..].to_string(), (ret, types));
            decl.clear();
        }
        out
    }

    #[test]
    fn the_header_declares_every_function_with_the_rust_signature() {
        let rust = rust_signatures();
        let header = header_signatures();
        assert_eq!(rust.len(), 30, "{:?}", rust.keys());
        for (name, signature) in &rust {
            assert_eq!(
                header.get(name),
                Some(signature),
                "te.h's declaration of {name}"
            );
        }
        assert_eq!(
            rust.keys().collect::<Vec<_>>(),
            header.keys().collect::<Vec<_>>()
        );
    }

    #[test]
    fn c_structs_have_the_sizes_te_h_asserts() {
        // tests/capi/te_test.c asserts the same sizes from the C side.
        assert_eq!(std::mem::size_of::<crate::TeRequest>(), 48);
        assert_eq!(std::mem::size_of::<crate::TePeerEvent>(), 560);
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
