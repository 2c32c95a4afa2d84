//! Without a usable shim the backend is registered but unavailable, with the reason;
//! a shim that refuses its options is a configuration error; a shim of an older ABI is
//! refused. The tests run one at a time, because one changes `TE_FLAGCX_SHIM` for the
//! whole process.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use te_core::{Config, Engine, ErrorKind, Registry};

use te_flagcx as _;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn reason() -> String {
    let registry = Registry::discover(&[]);
    let entry = registry.get(te_flagcx::NAME).expect("flagcx is registered");
    match entry.available() {
        Ok(()) => "available".into(),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Unavailable, "{e:?}");
            e.to_string()
        }
    }
}

fn config(table: &str) -> Config {
    let text = format!("[engine]\nbackend = \"flagcx\"\n[backends.flagcx]\n{table}\n");
    Config::from_toml(&text, "flagcx-unavailable.toml", Path::new(".")).expect("valid toml")
}

#[test]
fn the_backend_says_why_it_is_unavailable_and_refuses_bad_options() {
    let _g = serial();
    if te_flagcx::BUILT_SHIM.is_none() {
        std::env::remove_var(te_flagcx::SHIM_ENV);
        let r = reason();
        assert!(
            r.contains("no FlagCX shim")
                && r.contains(te_flagcx::SHIM_ENV)
                && r.contains("docs/flagcx.md"),
            "{r}"
        );
        let e = Engine::from_config(&config("")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e:?}");
    }

    std::env::set_var(te_flagcx::SHIM_ENV, "/nonexistent/libte_flagcx_shim.so");
    let r = reason();
    assert!(
        r.contains("/nonexistent/libte_flagcx_shim.so") && r.contains("cannot load"),
        "{r}"
    );

    // A real library that is not a shim: the first missing symbol is named.
    std::env::set_var(te_flagcx::SHIM_ENV, "libm.so.6");
    let r = reason();
    assert!(r.contains("lacks symbol `te_flagcx_shim_abi`"), "{r}");

    let fake = match option_env!("TE_FLAGCX_FAKE_SHIM_PATH") {
        Some(p) => p,
        None => {
            panic!("the fake FlagCX shim was not built (no C compiler?); see the build warnings")
        }
    };
    std::env::set_var(te_flagcx::SHIM_ENV, fake);
    assert_eq!(reason(), "available");
    for (table, needle) in [
        ("shim_options = \"speed=9\"", "speed"),
        ("shim_options = \"max_desc=lots\"", "max_desc"),
        ("polling = \"1ms\"", "polling"),
    ] {
        let e = Engine::from_config(&config(table)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConfigInvalid, "{e:?}");
        assert!(e.to_string().contains(needle), "{e}");
    }
}

/// A shim built from an older header (ABI 4, before connection attempts could be
/// cancelled one by one) is refused by its version, with what to do.
#[test]
fn a_shim_of_an_older_abi_is_refused_by_its_version() {
    let _g = serial();
    let old = match option_env!("TE_FLAGCX_OLD_ABI_SHIM_PATH") {
        Some(p) => p,
        None => panic!(
            "the old-ABI test library was not built (no C compiler?); see the build warnings"
        ),
    };
    let mut config = te_flagcx::FlagcxConfig::default();
    config.shim = Some(old.into());
    let e = te_flagcx::FlagcxBackend::new(config).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains(old)
            && text.contains("speaks ABI 4")
            && text.contains("this te speaks 5")
            && text.contains("rebuild the shim"),
        "{text}"
    );
}
