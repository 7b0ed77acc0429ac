//! The configuration parser's tests.
use super::*;

#[test]
fn defaults_when_empty() {
    assert_eq!(Config::parse("", "t").unwrap(), Config::default());
    assert_eq!(Config::parse(" , ,", "t").unwrap(), Config::default());
}

#[test]
fn parses_every_kind_of_value() {
    let c = Config::parse(
        "max_split_size_mb:256, garbage_collection_threshold:0.6,expandable_segments:True,\
         reuse:fenced,pool:off,stacks:python,stack_depth:30,trace_dir:/tmp/x,log:quiet,\
         per_process_memory_fraction:0.5,trace_files:3,compress:off,torch_caching:keep,clock:os",
        "t",
    )
    .unwrap();
    assert_eq!(c.allocator.max_split_size, 256 << 20);
    assert_eq!(c.allocator.garbage_collection_threshold, 0.6);
    assert_eq!(c.allocator.expandable_segments, Expandable::On);
    assert_eq!(c.allocator.reuse, ReusePolicy::Fenced);
    assert_eq!(c.allocator.per_process_memory_fraction, 0.5);
    assert!(!c.pool && !c.compress);
    assert_eq!(c.stacks, StackMode::Python);
    assert_eq!(c.stack_depth, 30);
    assert_eq!(c.trace_files, 3);
    assert_eq!(c.trace_dir, PathBuf::from("/tmp/x"));
    assert_eq!(c.log, LogLevel::Quiet);
    assert_eq!(c.torch_caching, TorchCaching::Keep);
    assert_eq!(c.clock, ClockChoice::Os);
}

#[test]
fn roundup_list_form_follows_pytorch() {
    let c = Config::parse("roundup_power2_divisions:[256:1,512:2,>:8]", "t").unwrap();
    let Roundup::PerInterval(table) = &c.allocator.roundup else {
        panic!("list form")
    };
    assert_eq!(table.len(), ROUNDUP_INTERVALS);
    assert!(
        table[..=8].iter().all(|&d| d == 1),
        "first entry covers smaller sizes"
    );
    assert_eq!(table[9], 2);
    assert!(table[10..].iter().all(|&d| d == 8), "'>' covers the rest");
    let c = Config::parse("roundup_power2_divisions:4", "t").unwrap();
    assert_eq!(c.allocator.roundup, Roundup::Uniform(4));
}

#[test]
fn errors_name_the_key_and_the_choices() {
    let e = Config::parse("reuse:sometimes", "CACHEALLOC_CONF").unwrap_err();
    let text = e.to_string();
    assert!(text.starts_with("CACHEALLOC_CONF: "), "{text}");
    assert!(
        text.contains("'reuse'") && text.contains("'sometimes'"),
        "{text}"
    );
    assert!(
        text.ends_with("; expected auto, fenced or immediate"),
        "{text}"
    );

    let e = Config::parse("max_split_mb:100", "t")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown key 'max_split_mb'") && e.contains("max_split_size_mb"),
        "{e}"
    );

    for bad in [
        "max_split_size_mb:20",
        "max_split_size_mb:lots",
        "garbage_collection_threshold:1.0",
        "garbage_collection_threshold:0",
        "per_process_memory_fraction:1.5",
        "per_process_memory_fraction:-0.1",
        "roundup_power2_divisions:3",
        "roundup_power2_divisions:[300:2]",
        "roundup_power2_divisions:[512:2,256:4]",
        "stack_depth:0",
        "trace:maybe",
        "novalue",
        "stacks:[python",
        "stacks:python]",
    ] {
        let e = Config::parse(bad, "t").unwrap_err().to_string();
        let key = bad.split([':', '[']).next().unwrap();
        assert!(e.contains(key) && e.starts_with("t: "), "{bad}: {e}");
    }
}

#[test]
fn every_keys_bad_value_names_the_key_the_value_and_the_valid_values() {
    for &Key {
        name: key, valid, ..
    } in KEYS
    {
        let value = if key == "trace_dir" { "" } else { "%bad%" };
        let e = Config::parse(&format!("{key}:{value}"), "t")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("t: bad value '{value}' for key '{key}'"))
                && e.ends_with(&format!("; expected {valid}")),
            "{key}: {e}"
        );
    }
    // Each example value in the table's own descriptions parses.
    for good in [
        "max_split_size_mb:unlimited",
        "roundup_power2_divisions:[256:1,512:2,>:8]",
        "reuse:fenced",
        "torch_caching:keep",
        "stacks:all",
        "log:debug",
        "driver_doors:off",
        "expandable_segments:True",
        "report_cached_as_free:false",
        "trace_mode:0640",
    ] {
        Config::parse(good, "t").unwrap_or_else(|e| panic!("{good}: {e}"));
    }
}

#[test]
fn pytorch_conf_is_honoured_and_cachealloc_wins() {
    let r = Config::from_sources(
        Some("max_split_size_mb:128"),
        Some("max_split_size_mb:64,backend:native,garbage_collection_threshold:0.7,future_key:1"),
    )
    .unwrap();
    assert_eq!(r.config.allocator.max_split_size, 128 << 20);
    assert_eq!(r.config.allocator.garbage_collection_threshold, 0.7);
    assert_eq!(r.ignored.len(), 2);
    assert!(r.ignored[0].contains("'backend'") && r.ignored[0].contains("PyTorch only"));
    assert!(r.ignored[1].contains("'future_key'"));
    // Our own keys are not taken from PyTorch's variable.
    let r = Config::from_sources(None, Some("pool:off")).unwrap();
    assert!(r.config.pool);
    assert_eq!(r.ignored.len(), 1);
}

#[test]
fn conf_string_round_trips() {
    let text = "max_split_size_mb:512,roundup_power2_divisions:[1:1,2:1,4:2,8:4,16:4,32:4,64:4,128:4,256:4,512:4,1024:4,2048:4,4096:4,8192:4,16384:4,32768:4],garbage_collection_threshold:0.5,reuse:immediate";
    let c = Config::parse(text, "t").unwrap();
    let again = Config::parse(&c.allocator.to_conf_string(), "t").unwrap();
    assert_eq!(c.allocator, again.allocator);
}

#[test]
fn trace_mode_is_an_octal_mode_of_read_and_write_bits_keeping_the_owners() {
    for (value, mode) in [
        ("0600", 0o600),
        ("640", 0o640),
        ("0o660", 0o660),
        ("0666", 0o666),
    ] {
        let c = Config::parse(&format!("trace_mode:{value}"), "t").unwrap();
        assert_eq!(c.trace_mode, mode, "{value}");
    }
    assert_eq!(Config::default().trace_mode, 0o600);
    for bad in ["0700", "0400", "0644x", "", "0o", "1600", "0601", "9"] {
        Config::parse(&format!("trace_mode:{bad}"), "t").unwrap_err();
    }
}

#[test]
fn nccl_registering_every_segment_keeps_pytorchs_memory_in_fixed_segments_unless_asked() {
    let resolve = |registers: bool, ours: Option<&str>, pytorchs: Option<&str>| {
        let mut c = Config::from_sources(ours, pytorchs).unwrap().config;
        let said = c.for_nccl_registration(registers, ours, pytorchs);
        (c.allocator.expandable_segments, said)
    };
    // Without the hook nothing changes.
    assert_eq!(
        resolve(false, None, None),
        (Expandable::StreamOrdered, None)
    );
    // The default gives way: fixed segments, said once.
    let (kind, said) = resolve(true, None, None);
    assert_eq!(kind, Expandable::Off);
    assert!(said.unwrap().contains("fixed segments"));
    let (kind, _) = resolve(true, Some("trace:off"), Some("max_split_size_mb:64"));
    assert_eq!(kind, Expandable::Off);
    // PyTorch's own expandable segments: PyTorch turns the registration off, nothing to say.
    let on = Some("expandable_segments:True");
    assert_eq!(resolve(true, None, on), (Expandable::On, None));
    // Asked for in CACHEALLOC_CONF only: kept, and the conflict named.
    let (kind, said) = resolve(true, on, None);
    assert_eq!(kind, Expandable::On);
    assert!(said.unwrap().contains("PYTORCH_CUDA_ALLOC_CONF"));
    // Already fixed: nothing to do.
    let off = Some("expandable_segments:False");
    assert_eq!(resolve(true, off, None), (Expandable::Off, None));
}

#[test]
fn expandable_segments_for_stream_ordered_allocations_are_the_default_and_recorded() {
    assert_eq!(
        Config::default().allocator.expandable_segments,
        Expandable::StreamOrdered
    );
    for (text, want) in [
        ("expandable_segments:False", Expandable::Off),
        ("expandable_segments:True", Expandable::On),
        (
            "expandable_segments:stream_ordered",
            Expandable::StreamOrdered,
        ),
    ] {
        let c = Config::parse(text, "t").unwrap();
        assert_eq!(c.allocator.expandable_segments, want, "{text}");
        let recorded = c.allocator.to_conf_string();
        let again = Config::parse_recorded(&recorded, "t").unwrap();
        assert_eq!(again.allocator, c.allocator, "{recorded}");
    }
    // A trace of 0.6 or before named the key only when it was on.
    let old = Config::parse_recorded("reuse:auto", "t").unwrap();
    assert_eq!(old.allocator.expandable_segments, Expandable::Off);
    let old = Config::parse_recorded("expandable_segments:True,reuse:auto", "t").unwrap();
    assert_eq!(old.allocator.expandable_segments, Expandable::On);
    let e = Config::parse("expandable_segments:sometimes", "t").unwrap_err();
    assert!(e.to_string().contains("stream_ordered"), "{e}");
}

#[test]
fn a_memory_fraction_of_zero_is_pytorchs_no_memory() {
    // PyTorch takes per_process_memory_fraction in [0.0, 1.0] (its test_allocator_memory_
    // fraction_setting reads 0.0 back).
    for (text, want) in [("0.0", 0.0), ("0", 0.0), ("0.5", 0.5), ("1.0", 1.0)] {
        let c = Config::parse(&format!("per_process_memory_fraction:{text}"), "t").unwrap();
        assert_eq!(c.allocator.per_process_memory_fraction, want, "{text}");
    }
}

#[test]
fn graph_capture_record_stream_reuse_is_read_from_pytorchs_variable_and_off_by_default() {
    assert!(!Config::default().graph_capture_record_stream_reuse);
    let r = Config::from_sources(None, Some("graph_capture_record_stream_reuse:True")).unwrap();
    assert!(r.config.graph_capture_record_stream_reuse);
    assert!(r.ignored.is_empty(), "{:?}", r.ignored);
    let err = Config::parse("graph_capture_record_stream_reuse:maybe", "CACHEALLOC_CONF")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("graph_capture_record_stream_reuse") && err.contains("True or False"),
        "{err}"
    );
}

#[test]
fn pytorchs_fraction_counts_its_memory_and_cachealloc_s_counts_everything() {
    let counts = |cachealloc, pytorch| {
        let r = Config::from_sources(cachealloc, pytorch).unwrap();
        (
            r.config.allocator.per_process_memory_fraction,
            r.config.allocator.fraction_counts_synchronous,
        )
    };
    assert_eq!(counts(None, None), (1.0, true));
    assert_eq!(
        counts(None, Some("per_process_memory_fraction:0.5")),
        (0.5, false)
    );
    assert_eq!(
        counts(Some("per_process_memory_fraction:0.25"), None),
        (0.25, true)
    );
    assert_eq!(
        counts(
            Some("per_process_memory_fraction:0.25"),
            Some("per_process_memory_fraction:0.5")
        ),
        (0.25, true),
        "cachealloc's own setting rules"
    );
    assert_eq!(
        counts(Some("log:quiet"), Some("max_split_size_mb:64")),
        (1.0, true)
    );
}
