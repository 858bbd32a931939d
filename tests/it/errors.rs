//! Bad input: every kind gets exit status 2, one `error:` message on stderr that names the file
//! (for file problems) and says what is wrong, nothing on stdout, and no panic.
//!
//! The broken model files are in `tests/fixtures/`; assertions are on substrings of stderr.

use crate::common::{TempModel, code, describe, memest, memest_stdin, stderr};

/// Runs memest and checks the common shape of a bad-input failure; returns stderr.
fn fails(args: &[&str]) -> String {
    check_failure(&memest(args))
}

fn check_failure(out: &std::process::Output) -> String {
    let err = stderr(out);
    assert_eq!(code(out), 2, "expected exit status 2\n{}", describe(out));
    assert!(
        err.starts_with("error:"),
        "stderr should start with `error:`\n{}",
        describe(out)
    );
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "memest panicked\n{}",
        describe(out)
    );
    assert!(
        out.stdout.is_empty(),
        "nothing should be printed on stdout\n{}",
        describe(out)
    );
    err
}

/// Runs memest on `tests/fixtures/NAME` and checks that the message names that file.
fn fixture_fails(name: &str, extra: &[&str]) -> String {
    let file = format!("tests/fixtures/{name}");
    let mut args = vec![file.as_str()];
    args.extend_from_slice(extra);
    let err = fails(&args);
    assert!(
        err.starts_with(&format!("error: {file}:")),
        "the message should start by naming the file {file}:\n{err}"
    );
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "a file error is one line:\n{err}"
    );
    err
}

fn assert_has(err: &str, needles: &[&str]) {
    for n in needles {
        assert!(err.contains(n), "stderr should contain {n:?}:\n{err}");
    }
}

#[test]
fn toml_syntax_error_has_line_and_column() {
    let err = fixture_fails("syntax_error.toml", &[]);
    assert_has(&err, &["error: tests/fixtures/syntax_error.toml:8:16:"]);
}

#[test]
fn unknown_key_is_named_with_a_suggestion() {
    let err = fixture_fails("unknown_key.toml", &[]);
    assert_has(
        &err,
        &[
            "unknown_key.toml:8:1:",
            "`out_feature`",
            "did you mean `out_features`?",
        ],
    );
}

#[test]
fn unknown_key_in_json_is_named_with_a_suggestion() {
    let err = fixture_fails("unknown_key.json", &[]);
    assert_has(
        &err,
        &[
            "unknown_key.json:4:",
            "`out_feature`",
            "did you mean `out_features`?",
        ],
    );
}

#[test]
fn unknown_kind_suggests_the_nearest() {
    let err = fixture_fails("unknown_kind.toml", &[]);
    assert_has(
        &err,
        &[
            "unknown_kind.toml:6:8:",
            "unknown layer kind `lienar`",
            "did you mean `linear`?",
        ],
    );
}

#[test]
fn missing_required_field_names_the_layer_and_the_key() {
    let err = fixture_fails("missing_field.toml", &[]);
    assert_has(
        &err,
        &["layer #2 \"head\" (linear)", "missing `out_features`"],
    );
}

#[test]
fn missing_field_inside_a_block_names_the_path() {
    let m = TempModel::new(
        "toml",
        "[input]\nshape = [4]\n[[layers]]\nkind = \"repeat\"\nname = \"blk\"\ncount = 2\n  [[layers.layers]]\n  kind = \"relu\"\n  [[layers.layers]]\n  kind = \"linear\"\n  name = \"x\"\n",
    );
    let err = fails(&[m.arg()]);
    assert_has(
        &err,
        &[
            m.arg(),
            "layer #1 \"blk\" (repeat) > layer #2 \"x\" (linear)",
            "missing `out_features`",
        ],
    );
}

#[test]
fn conv2d_on_a_rank_2_input_is_a_shape_mismatch() {
    let err = fixture_fails("conv_on_rank2.toml", &[]);
    assert_has(&err, &["layer #1 \"conv\" (conv2d)", "rank 2", "rank 4"]);
}

#[test]
fn linear_in_features_mismatch() {
    let err = fixture_fails("in_features_mismatch.toml", &[]);
    assert_has(
        &err,
        &[
            "layer #2 \"fc2\" (linear)",
            "32 features",
            "in_features = 64",
        ],
    );
}

#[test]
fn zero_size_is_rejected() {
    let err = fixture_fails("zero_size.toml", &[]);
    assert_has(
        &err,
        &[
            "layer #1 \"fc1\" (linear)",
            "`out_features` must be positive, got 0",
        ],
    );
}

#[test]
fn negative_size_is_a_type_error_with_position() {
    let err = fixture_fails("negative_size.toml", &[]);
    assert_has(&err, &["negative_size.toml:8:16:", "-3"]);
}

#[test]
fn empty_file() {
    let err = fixture_fails("empty.toml", &[]);
    assert_has(&err, &["empty"]);
}

#[test]
fn missing_file() {
    let err = fails(&["tests/fixtures/no-such-model.toml"]);
    assert_has(
        &err,
        &["tests/fixtures/no-such-model.toml", "failed to read"],
    );
}

#[test]
fn a_directory_is_not_a_model_file() {
    let err = fails(&["tests/fixtures"]);
    assert_has(&err, &["tests/fixtures", "failed to read"]);
}

#[test]
fn non_utf8_file() {
    let m = TempModel::new("toml", "");
    std::fs::write(m.path(), b"[input]\nshape = [\xff\xfe]\n").unwrap();
    let err = fails(&[m.arg()]);
    assert_has(&err, &[m.arg(), "UTF-8"]);
}

#[test]
fn endless_file_is_refused_at_the_size_limit() {
    // `/dev/zero` never ends: memest stops one byte past its 64 MiB limit.
    let err = fails(&["/dev/zero"]);
    assert_has(&err, &["/dev/zero is larger than 64 MiB (67108864 bytes)"]);
}

#[test]
fn stdin_over_the_size_limit_is_refused() {
    let big = " ".repeat((64 << 20) + 1);
    let err = check_failure(&memest_stdin(&["-"], &big));
    assert_has(&err, &["standard input is larger than 64 MiB"]);
}

#[test]
fn operator_cap_multiplies_nested_counts() {
    // 100 copies of a block of 100,000 copies of one linear: 20,000,000 operators. Each block
    // alone is under the cap, and the symbolic path's few-copy traces were too: it used to trace
    // 1.2 to 1.8 million operators three times (over 60 s and 3.5 GB) before unrolling refused it.
    let src = "[input]\nshape = [1000]\n[[layers]]\nname = \"outer\"\nkind = \"repeat\"\ncount = 100\n  [[layers.layers]]\n  name = \"inner\"\n  kind = \"repeat\"\n  count = 100000\n    [[layers.layers.layers]]\n    kind = \"linear\"\n    out_features = 1000\n";
    let m = TempModel::new("toml", src);
    let start = std::time::Instant::now();
    let err = fails(&[m.arg()]);
    assert_has(
        &err,
        &[
            ":7:3: layer #1 \"outer\" (repeat) > layer #1 \"inner\" (repeat): 100000 copies (`count`) of 2 operators each, in 100 copies of the enclosing blocks, make 20000000 operators",
            "more than the 2000000 operators memest traces; lower `count` or the enclosing blocks' `count`",
        ],
    );
    assert!(start.elapsed().as_secs() < 20, "{:?}", start.elapsed());
}

#[test]
fn a_huge_name_gets_no_suggestion_quickly() {
    // Comparing a megabyte-long name with each candidate used to take seconds.
    let name = "x".repeat(1 << 20);
    let src = format!("[input]\nshape = [4]\n[[layers]]\nkind = \"{name}\"\n");
    let start = std::time::Instant::now();
    let err = check_failure(&memest_stdin(&["-"], &src));
    assert!(
        err.contains("unknown") && !err.contains("did you mean"),
        "{err:.200}"
    );
    assert!(start.elapsed().as_secs() < 20, "{:?}", start.elapsed());
}

#[test]
fn operator_cap_is_checked_before_unrolling() {
    // A 182-byte file with a billion copies: refused from the first copy's operator count, at
    // once and without allocating the others (it used to take 1.3 GB first), with or without a
    // search.
    let src = "[input]\nshape = [512]\n[[layers]]\nkind = \"repeat\"\ncount = 1000000000\n[[layers.layers]]\nkind = \"linear\"\nout_features = 512\n[[layers.layers]]\nkind = \"relu\"\n";
    let m = TempModel::new("toml", src);
    for extra in [&[][..], &["--budget", "80GB", "--max-batch"]] {
        let mut args = vec![m.arg()];
        args.extend_from_slice(extra);
        let start = std::time::Instant::now();
        let err = fails(&args);
        assert_has(
            &err,
            &[
                ":3:1: layer #1 \"repeat1\" (repeat): 1000000000 copies (`count`) of 3 operators each",
                "more than the 2000000 operators memest traces; lower `count`",
            ],
        );
        assert!(start.elapsed().as_secs() < 20, "{:?}", start.elapsed());
    }
}

#[test]
fn operator_cap_names_the_hugging_face_field() {
    let src = std::fs::read_to_string(crate::common::path("examples/hf/llama_tiny.json"))
        .unwrap()
        .replace("\"num_hidden_layers\": 4", "\"num_hidden_layers\": 100000");
    let m = TempModel::new("json", &src);
    let err = fails(&[m.arg(), "--seq", "16"]);
    assert_has(
        &err,
        &[
            "100000 copies (`num_hidden_layers`) of",
            "lower `num_hidden_layers`",
        ],
    );
}

#[test]
fn unknown_input_name_gets_a_hint() {
    let err = fixture_fails("unknown_input.toml", &[]);
    assert_has(
        &err,
        &[
            "layer #2 \"residual\" (add)",
            "input `fc` names no earlier layer",
            "did you mean `fc1`?",
        ],
    );
}

#[test]
fn repeat_body_that_changes_shape() {
    let err = fixture_fails("repeat_changes_shape.toml", &[]);
    assert_has(
        &err,
        &["layer #1 \"blocks\" (repeat)", "[1, 16]", "[1, 32]"],
    );
}

#[test]
fn repeat_body_that_changes_shape_is_fine_once() {
    let src = std::fs::read_to_string(crate::common::path(
        "tests/fixtures/repeat_changes_shape.toml",
    ))
    .unwrap()
    .replace("count = 3", "count = 1");
    let m = TempModel::new("toml", &src);
    let out = memest(&[m.arg(), "--format", "json"]);
    let v = crate::common::json(&out);
    assert_eq!(crate::common::u(&v, "param_count"), 16 * 32 + 32);
}

#[test]
fn batch_zero_is_a_usage_error() {
    let err = fails(&["examples/mlp.toml", "--batch", "0"]);
    assert_has(&err, &["--batch", "'0'"]);
}

#[test]
fn seq_zero_is_a_usage_error() {
    let err = fails(&["examples/gpt2.toml", "--seq", "0"]);
    assert_has(&err, &["--seq", "'0'"]);
}

#[test]
fn unknown_flag_value_is_a_usage_error() {
    let err = fails(&["examples/mlp.toml", "--optim", "adamm"]);
    assert_has(&err, &["adamm", "--optim"]);
}

#[test]
fn bad_budget_names_the_size() {
    let err = fails(&["examples/mlp.toml", "--budget", "12XB"]);
    assert_has(&err, &["12XB", "--budget", "unknown unit"]);
}

#[test]
fn seq_input_without_a_length() {
    let err = fixture_fails("seq_without_length.toml", &[]);
    assert_has(&err, &["\"seq\"", "--seq"]);
    // ...and giving one fixes it.
    let out = memest(&["tests/fixtures/seq_without_length.toml", "--seq", "8"]);
    assert_eq!(code(&out), 0, "{}", describe(&out));
}

#[test]
fn json_syntax_error_has_line_and_column() {
    let err = fixture_fails("syntax_error.json", &[]);
    assert_has(
        &err,
        &["error: tests/fixtures/syntax_error.json:4:24:", "expected"],
    );
}

#[test]
fn stdin_errors_name_stdin() {
    let out = memest_stdin(&["-"], "[input]\nshape = [4\n");
    let err = check_failure(&out);
    assert_has(&err, &["error: <stdin>:2:"]);
}

#[test]
fn empty_stdin() {
    let out = memest_stdin(&["-"], "");
    let err = check_failure(&out);
    assert_has(&err, &["<stdin>", "empty"]);
}

#[test]
fn size_overflow_is_an_error_not_a_panic() {
    let err = fails(&["examples/mlp.toml", "--batch", "18446744073709551615"]);
    assert_has(&err, &["examples/mlp.toml", "overflow"]);
    let m = TempModel::new(
        "toml",
        "[input]\nshape = [4]\n[[layers]]\nkind = \"linear\"\nout_features = 18446744073709551615\n",
    );
    let err = fails(&[m.arg()]);
    assert_has(&err, &[m.arg(), "overflow"]);
}

#[test]
fn amp_with_a_16_bit_dtype() {
    let err = fails(&["examples/mlp.toml", "--amp", "bf16", "--dtype", "bfloat16"]);
    assert_has(&err, &["examples/mlp.toml", "--amp"]);
}

#[test]
fn key_that_does_not_apply_to_the_kind() {
    let m = TempModel::new(
        "toml",
        "[input]\nshape = [4]\n[[layers]]\nkind = \"linear\"\nout_features = 3\nkernel = 3\n",
    );
    let err = fails(&[m.arg()]);
    assert_has(&err, &["(linear)", "`kernel` does not apply to `linear`"]);
}

#[test]
fn upsample_needs_a_scale_or_a_size() {
    let model = |keys: &str| {
        TempModel::new(
            "toml",
            &format!("[input]\nshape = [2, 4, 4]\n[[layers]]\nkind = \"upsample\"\n{keys}"),
        )
    };
    let m = model("mode = \"bilinear\"\n");
    let err = fails(&[m.arg()]);
    assert_has(&err, &["(upsample)", "missing `scale_factor` or `size`"]);
    let m = model("scale_factor = 2\nsize = [8, 8]\n");
    assert_has(&fails(&[m.arg()]), &["not both"]);
    let m = model("scale_factor = 2\nalign_corners = true\n");
    assert_has(&fails(&[m.arg()]), &["`align_corners` applies only"]);
    let m = model("scale_factor = 2\nmode = \"reflect\"\n");
    assert_has(&fails(&[m.arg()]), &["not an `upsample` mode"]);
    let m = model("scale_factor = 2\nmode = \"linear\"\n");
    assert_has(&fails(&[m.arg()]), &["rank 3 [batch, channels, length]"]);
}

#[test]
fn pad_needs_widths_that_fit() {
    let model = |keys: &str| {
        TempModel::new(
            "toml",
            &format!("[input]\nshape = [2, 4, 4]\n[[layers]]\nkind = \"pad\"\n{keys}"),
        )
    };
    let m = model("mode = \"reflect\"\n");
    assert_has(&fails(&[m.arg()]), &["(pad)", "missing `pad`"]);
    let m = model("pad = [1, 1, 1]\n");
    assert_has(&fails(&[m.arg()]), &["two widths per padded dimension"]);
    let m = model("pad = [1, 1]\nmode = \"reflect\"\nvalue = 1.0\n");
    assert_has(&fails(&[m.arg()]), &["`value` applies only"]);
    let m = model("pad = [1, 1]\nmode = \"bilinear\"\n");
    assert_has(&fails(&[m.arg()]), &["not a `pad` mode"]);
    // Reflect pads both spatial dimensions of [B, C, H, W], by less than their size.
    let m = model("pad = [1, 1]\nmode = \"reflect\"\n");
    assert_has(&fails(&[m.arg()]), &["rank 3 [batch, channels, ..]"]);
    let m = model("pad = [4, 0, 0, 0]\nmode = \"reflect\"\n");
    assert_has(&fails(&[m.arg()]), &["width 4 does not fit dimension 3"]);
}

#[test]
fn conv3d_takes_three_sizes_and_a_rank_5_input() {
    let model = |shape: &str, keys: &str| {
        TempModel::new(
            "toml",
            &format!(
                "[input]\nshape = {shape}\n[[layers]]\nkind = \"conv3d\"\nout_channels = 2\n{keys}"
            ),
        )
    };
    let m = model("[2, 4, 4, 4]", "kernel = [3, 3]\n");
    assert_has(
        &fails(&[m.arg()]),
        &[
            "(conv3d)",
            "`kernel` [3, 3] gives two sizes; `conv3d` takes one or [d, h, w]",
        ],
    );
    let m = model("[2, 4, 4]", "kernel = 3\n");
    assert_has(
        &fails(&[m.arg()]),
        &["rank 5 [batch, channels, depth, height, width]"],
    );
    let m = model("[2, 4, 4, 4]", "kernel = [3, 3, 3]\nstride = [1, 0, 1]\n");
    assert_has(
        &fails(&[m.arg()]),
        &["`stride` must be positive, got [1, 0, 1]"],
    );
}

#[test]
fn shares_names_an_earlier_layer_of_the_same_kind_and_config() {
    let model = |second: &str| {
        TempModel::new(
            "toml",
            &format!(
                "[input]\nshape = [8]\n[[layers]]\nkind = \"linear\"\nname = \"fc\"\nout_features = 8\n[[layers]]\n{second}"
            ),
        )
    };
    let m = model("kind = \"linear\"\nname = \"fc2\"\nout_features = 8\nshares = \"fcc\"\n");
    assert_has(
        &fails(&[m.arg()]),
        &[
            "\"fc2\"",
            "`shares` names `fcc`, which is no earlier layer",
            "did you mean `fc`?",
        ],
    );
    let m =
        model("kind = \"conv1d\"\nname = \"c\"\nout_channels = 8\nkernel = 1\nshares = \"fc\"\n");
    assert_has(
        &fails(&[m.arg()]),
        &["layer `c` (conv1d) shares `fc`, which is a `linear`"],
    );
    let m = model("kind = \"linear\"\nname = \"fc2\"\nout_features = 4\nshares = \"fc\"\n");
    assert_has(
        &fails(&[m.arg()]),
        &[
            "layer `fc2` shares `fc`, but their configs differ: write `fc2` with the keys of `fc` (`out_features` = 8 in `fc`, 4 in `fc2`)",
        ],
    );
    // Same config, but the input is wider than the shared weight.
    let m = TempModel::new(
        "toml",
        "[input]\nshape = [8]\n[[layers]]\nkind = \"linear\"\nname = \"fc\"\nout_features = 16\n[[layers]]\nkind = \"linear\"\nname = \"fc2\"\nout_features = 16\nshares = \"fc\"\n",
    );
    assert_has(
        &fails(&[m.arg()]),
        &["the shared parameter has shape [16, 8], this layer's input needs [16, 16]"],
    );
}

// ---- bugs found while writing these tests (fixed since) ----

#[test]

fn batchnorm2d_on_a_rank_2_input() {
    let err = fixture_fails("batchnorm2d_on_rank2.toml", &[]);
    assert_has(&err, &["layer #1 \"bn\" (batchnorm2d)", "rank 2"]);
}

#[test]

fn batchnorm1d_on_a_rank_4_input() {
    let err = fixture_fails("batchnorm1d_on_rank4.toml", &[]);
    assert_has(&err, &["layer #1 \"bn\" (batchnorm1d)", "rank 4"]);
}

#[test]

fn batchnorm_num_features_mismatch() {
    let err = fixture_fails("batchnorm_num_features_mismatch.toml", &[]);
    assert_has(
        &err,
        &["layer #2 \"bn\" (batchnorm2d)", "num_features", "64"],
    );
}

#[test]

fn pool_padding_above_half_the_window() {
    let err = fixture_fails("pool_padding_too_large.toml", &[]);
    assert_has(&err, &["layer #1 \"pool\" (maxpool2d)", "padding"]);
}

#[test]

fn json_top_level_array_gets_a_clear_message() {
    let err = fixture_fails("top_level_array.json", &[]);
    assert_has(&err, &["object"]);
    assert!(!err.contains("expected a string"), "{err}");
    assert!(!err.contains("ModelSpec"), "{err}");
}

/// The library's errors say where they come from, as data.
mod typed {
    use memest::error::{Error, HfError, LayerErrorKind, SettingKey};
    use memest::settings::Overrides;
    use memest::spec::Format;

    fn estimate(src: &str, format: Format, o: &Overrides) -> Error {
        memest::estimate(src, format, "m", o, None).unwrap_err()
    }

    #[test]
    fn a_bad_flag_is_a_setting_error_naming_the_setting() {
        let o = Overrides {
            batch: Some(0),
            ..Overrides::default()
        };
        let src = "[input]\nshape = [4]\n[[layers]]\nkind = \"relu\"\n";
        let Error::Setting(e) = estimate(src, Format::Toml, &o) else {
            panic!("expected a setting error")
        };
        assert_eq!(e.key, SettingKey::Batch);
        assert_eq!(e.message, "batch size must be at least 1");
    }

    #[test]
    fn a_model_without_layers_is_a_model_error() {
        let src = "layers = []\n[input]\nshape = [4]\n";
        let e = estimate(src, Format::Toml, &Overrides::default());
        assert!(matches!(e, Error::Model(_)), "{e:?}");
        assert_eq!(e.position(), None);
    }

    #[test]
    fn a_layer_error_names_the_layer() {
        let src = "[input]\nshape = [4]\n[[layers]]\nkind = \"linear\"\nname = \"fc\"\nout_features = 0\n";
        let Error::Layer(e) = estimate(src, Format::Toml, &Overrides::default()) else {
            panic!("expected a layer error")
        };
        assert_eq!(e.layer.label, "layer #1 \"fc\" (linear)");
        assert_eq!(e.layer.positions, [1]);
        assert!(matches!(e.kind, LayerErrorKind::Invalid(_)), "{e:?}");
    }

    #[test]
    fn shape_mismatches_carry_the_shapes() {
        let conv =
            "[input]\nshape = [100]\n[[layers]]\nkind = \"conv2d\"\nout_channels = 4\nkernel = 3\n";
        let Error::Layer(e) = estimate(conv, Format::Toml, &Overrides::default()) else {
            panic!("expected a layer error")
        };
        let LayerErrorKind::Rank { input, expected } = &e.kind else {
            panic!("{e:?}")
        };
        assert_eq!(input.dims(), [1, 100]);
        assert_eq!(expected, "rank 4 [batch, channels, height, width]");
        let linear = "[input]\nshape = [100]\n[[layers]]\nkind = \"linear\"\nin_features = 64\nout_features = 4\n";
        let Error::Layer(e) = estimate(linear, Format::Toml, &Overrides::default()) else {
            panic!("expected a layer error")
        };
        assert_eq!(
            e.kind,
            LayerErrorKind::Size {
                input: memest::shape::Shape::from([1, 100]),
                what: "features",
                got: 100,
                key: "in_features",
                expected: 64,
            }
        );
    }

    #[test]
    fn a_layer_error_in_toml_points_at_the_layer() {
        let src = "[input]\nshape = [16]\n\n[[layers]]\nkind = \"repeat\"\nname = \"blk\"\n\n  [[layers.layers]]\n  kind = \"relu\"\n\n  [[layers.layers]]\n  kind = \"linear\"\n  in_features = 3\n  out_features = 16\n";
        let e = estimate(src, Format::Toml, &Overrides::default());
        let Error::Layer(layer) = &e else {
            panic!("expected a layer error: {e:?}")
        };
        assert_eq!(layer.layer.positions, [1, 2]);
        let located = memest::locate(e, "m.toml", src, Format::Toml);
        assert_eq!(located.position, Some((11, 3)));
        assert!(
            located.to_string().starts_with(
                "m.toml:11:3: layer #1 \"blk\" (repeat) > layer #2 \"linear2\" (linear): "
            ),
            "{located}"
        );
        // JSON has no spans: the label alone says where.
        let json = r#"{"input": {"shape": [16]}, "layers": [{"kind": "linear", "in_features": 3, "out_features": 4}]}"#;
        let e = estimate(json, Format::Json, &Overrides::default());
        let located = memest::locate(e, "m.json", json, Format::Json);
        assert_eq!(located.position, None);
        assert!(
            located.to_string().starts_with("m.json: layer #1"),
            "{located}"
        );
    }

    #[test]
    fn a_syntax_error_has_a_position_and_the_origin_goes_first() {
        let e = estimate("[input]\nshape = [4\n", Format::Toml, &Overrides::default());
        let (line, _) = e.position().expect("a position");
        assert_eq!(line, 2);
        let shown = e.clone().at("m.toml").to_string();
        assert!(shown.starts_with("m.toml:2:"), "{shown}");
    }

    #[test]
    fn a_hugging_face_error_names_the_field() {
        let src = r#"{"model_type": "llama", "num_hidden_layers": 2, "vocab_size": 100}"#;
        let e = estimate(src, Format::Json, &Overrides::default());
        let Error::Hf(HfError {
            model_type, field, ..
        }) = &e
        else {
            panic!("expected an import error: {e:?}")
        };
        assert_eq!(model_type.as_deref(), Some("llama"));
        assert_eq!(field.as_deref(), Some("hidden_size"), "{e}");
        let typed = r#"{"model_type": "gpt2", "n_embd": "768"}"#;
        let e = estimate(typed, Format::Json, &Overrides::default());
        let Error::Hf(HfError {
            field, position, ..
        }) = &e
        else {
            panic!("expected an import error: {e:?}")
        };
        assert_eq!(field.as_deref(), Some("n_embd"));
        assert!(position.is_some(), "{e}");
    }
}

/// The first error is the real one: a layer whose kind is unknown is reported as such even when
/// an unknown key comes before `kind`, at the layer's line; an unknown key of a known kind lists
/// that kind's keys only, with no misleading suggestion (`kernel_size` is not a linear key).
#[test]
fn an_unknown_kind_comes_before_its_keys() {
    let m = TempModel::new(
        "toml",
        "[input]\nshape = [8]\n\n[[layers]]\nkernel_size = 3\nkind = \"linaer\"\n",
    );
    let err = fails(&[m.arg()]);
    assert!(
        err.starts_with(&format!(
            "error: {}:4:1: unknown layer kind `linaer` (did you mean `linear`?); expected one of repeat, linear,",
            m.arg()
        )),
        "{err}"
    );
    let m = TempModel::new(
        "toml",
        "[input]\nshape = [8]\n\n[[layers]]\nkernel_size = 3\nkind = \"linear\"\nout_features = 4\n",
    );
    assert_eq!(
        fails(&[m.arg()]),
        format!(
            "error: {}:5:1: unknown key `kernel_size` for `linear`; its keys: in_features, \
             out_features, bias, tie, quantize; every layer's: kind, name, inputs, trainable, shares, note\n",
            m.arg()
        )
    );
    let m = TempModel::new(
        "json",
        r#"{"input": {"shape": [8]}, "layers": [{"kernel_size": 3, "kind": "linaer"}]}"#,
    );
    assert!(fails(&[m.arg()]).contains("unknown layer kind `linaer` (did you mean `linear`?)"));
}

/// Suggestions that help: none for a real name of another thing (`elu` is not `relu`, `maxpool3d`
/// not `maxpool2d`); the case of a name is not a typo (`AdamW` in a file is `adamw`); `gpu` is
/// `cuda`. Messages use no Rust type names.
#[test]
fn suggestions_help_or_stay_silent() {
    for (kind, wrong) in [("elu", "relu"), ("maxpool3d", "maxpool2d")] {
        let m = TempModel::new(
            "toml",
            &format!("[input]\nshape = [8]\n[[layers]]\nkind = \"{kind}\"\n"),
        );
        let err = fails(&[m.arg()]);
        assert!(
            err.contains(&format!("unknown layer kind `{kind}`; expected one of")),
            "{err}"
        );
        assert!(!err.contains(&format!("did you mean `{wrong}`")), "{err}");
    }
    let m = TempModel::new(
        "toml",
        "[input]\nshape = [8]\n[defaults]\noptimizer = \"AdamW\"\n[[layers]]\nkind = \"Linear\"\nout_features = 4\n",
    );
    let out = memest(&[m.arg(), "--device", "gpu", "--format", "json"]);
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["settings"]["optimizer"], "adamw");
    assert_eq!(v["settings"]["device"], "cuda");
    let m = TempModel::new(
        "toml",
        "[input]\nshape = [8]\n[[layers]]\nkind = \"linear\"\nout_features = 99999999999999999999\n",
    );
    let err = fails(&[m.arg()]);
    assert!(
        err.ends_with(
            ":5:16: `out_features`: expected a whole number (0 or more), got 99999999999999999999, which is too large\n"
        ),
        "{err}"
    );
}

/// A memest JSON file with Python's `NaN` says what is wrong instead of "expected value".
#[test]
fn python_nan_in_a_memest_json_file_is_explained() {
    let m = TempModel::new(
        "json",
        r#"{"input":{"shape":[8]},"layers":[{"kind":"dropout","p":NaN}]}"#,
    );
    assert_eq!(
        fails(&[m.arg()]),
        format!(
            "error: {}:1:56: `NaN` is not a JSON number (Python's json writes it for a float that \
             is not finite); write a finite number\n",
            m.arg()
        )
    );
}

/// A layer written as a list rather than a table is refused in the reader's words (it was
/// `invalid length 1, expected struct FlatLayer with 121 elements`, serde's positional form
/// of a struct), with its position.
#[test]
fn a_layer_written_as_a_list_is_refused_plainly() {
    let json = TempModel::new(
        "json",
        "{\"input\": {\"shape\": [4]}, \"layers\": [[\"relu\"]]}",
    );
    let err = fails(&[json.arg()]);
    assert_has(&err, &[":1:38: expected a table of keys, got a list"]);
    assert!(!err.contains("struct"), "{err}");
    let toml = TempModel::new("toml", "layers = [[\"relu\"]]\n[input]\nshape = [4]\n");
    let err = fails(&[toml.arg()]);
    assert_has(&err, &[":1:11: expected a table of keys, got a list"]);
}
