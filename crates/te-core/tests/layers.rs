//! te-core's modules form layers without circles: no module reaches, through the
//! modules it names (`crate::…`), back to itself. docs/decisions.md ("te-core in
//! layers") draws the layers; this keeps them so.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every top-level module and the top-level modules its code (tests left out) names.
fn edges() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap();
            let first = rel
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy();
            let module = first.trim_end_matches(".rs").to_string();
            if module == "lib" || rel.ends_with("tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            // Unit tests may reach anywhere.
            let code = text.split("#[cfg(test)]\nmod tests {").next().unwrap();
            let names = out.entry(module.clone()).or_default();
            for (i, _) in code.match_indices("crate::") {
                let name: String = code[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                // Macros and their helpers are reached through the crate root.
                let macros = [
                    "",
                    "register_runtime",
                    "register_backend",
                    "inventory",
                    "__abi",
                ];
                if name != module && !macros.contains(&name.as_str()) {
                    names.insert(name);
                }
            }
        }
    }
    out
}

#[test]
fn te_core_modules_form_layers_without_circles() {
    let edges = edges();
    // Depth-first search for a path from each module back to itself.
    for start in edges.keys() {
        let mut stack: Vec<Vec<&str>> = vec![vec![start.as_str()]];
        let mut seen = BTreeSet::new();
        while let Some(path) = stack.pop() {
            let last = *path.last().unwrap();
            for next in edges.get(last).into_iter().flatten() {
                if next == start {
                    let mut circle = path.clone();
                    circle.push(next);
                    panic!("te-core has a circle: {}", circle.join(" → "));
                }
                if seen.insert(next.as_str()) {
                    let mut longer = path.clone();
                    longer.push(next);
                    stack.push(longer);
                }
            }
        }
    }
}
