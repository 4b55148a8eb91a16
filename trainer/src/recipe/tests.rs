//! Every shipped recipe validates; broken ones are rejected with the field and its line.

use super::*;

fn recipes_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../recipes")
}

fn tiny() -> String {
    std::fs::read_to_string(recipes_dir().join("tiny.ron")).unwrap()
}

/// The 1-based line of the first occurrence of `needle`.
fn line_of_text(text: &str, needle: &str) -> usize {
    let at = text
        .find(needle)
        .unwrap_or_else(|| panic!("{needle:?} not in the text"));
    text[..at].matches('\n').count() + 1
}

/// `tiny.ron` with `from` replaced by `to` (which must occur).
fn edited(from: &str, to: &str) -> String {
    let text = tiny();
    assert!(text.contains(from), "{from:?} not in tiny.ron");
    text.replacen(from, to, 1)
}

fn error(text: &str) -> String {
    match Plan::from_text(text, "tiny.ron") {
        Ok(_) => panic!("the recipe should be rejected"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_shipped_recipe_parses_and_validates() {
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(recipes_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "ron") {
            let plan = Plan::load(&path).unwrap_or_else(|e| panic!("{e}"));
            assert!(!plan.train_tasks.is_empty());
            seen.push(path.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            "a100.ron",
            "laptop-multihop.ron",
            "laptop.ron",
            "tiny-grpo.ron",
            "tiny.ron"
        ]
    );
    // The two-family laptop recipe: short multi-hop traces, room for four hops and the answer.
    let multihop = Plan::load(&recipes_dir().join("laptop-multihop.ron")).unwrap();
    assert!(multihop.sft.as_ref().is_some_and(|s| s.traces.short_search));
    assert_eq!(multihop.env.max_turns, 5);
    // The recipe that made tiny-grpo.ron's starting adapter.
    let sft = recipes_dir().join("../fixtures/tiny-sft-needle/sft.ron");
    let plan = Plan::load(&sft).unwrap_or_else(|e| panic!("{e}"));
    assert!(plan.sft.as_ref().is_some_and(|s| s.traces.short_search));
    // The embedded default is the file.
    let laptop = Plan::laptop().unwrap();
    assert_eq!(laptop.model.source, ModelSource::DefaultBase);
    assert_eq!(laptop.device.backend, Backend::Cpu);
}

#[test]
fn the_a100_recipe_is_the_reference_run() {
    let plan = Plan::load(&recipes_dir().join("a100.ron")).unwrap();
    let Tuning::Lora(lora) = &plan.model.tuning else {
        panic!("LoRA expected")
    };
    assert_eq!((lora.rank, lora.alpha), (16, 32.0));
    assert_eq!(lora.targets, fathom_model::Target::ALL.to_vec());
    assert_eq!(
        plan.model.quantization,
        Quantization::Nf4 { double_quant: true }
    );
    assert!(
        matches!(&plan.model.source, ModelSource::HuggingFace { path } if path.ends_with("Qwen2.5-Coder-1.5B-Instruct"))
    );
    assert_eq!(plan.device.backend, Backend::Cuda);
    assert_eq!(plan.grpo.group_size, 8);
    assert_eq!(plan.grpo.steps, 200);
    assert_eq!(plan.grpo.optimizer.lr, 5e-6);
    assert_eq!(plan.grpo.loss.beta, 0.0);
    assert!(plan.sft.is_some());
    assert_eq!(plan.rewards.len(), 4);
    assert_eq!(plan.env.max_turns, 12);
}

#[test]
fn the_tiny_recipe_resolves_a_small_random_model() {
    let plan = Plan::from_text(&tiny(), "tiny.ron").unwrap();
    let ModelSource::Random {
        shape,
        tokenizer,
        embedding_std,
    } = &plan.model.source
    else {
        panic!("random model expected")
    };
    assert!(tokenizer.ends_with("compact-tokenizer"));
    assert_eq!(*embedding_std, Some(0.25));
    let config = shape.config(1024).unwrap();
    assert_eq!((config.hidden_size, config.num_hidden_layers), (64, 2));
    // Families needle and compare only: indices 0, 3, 5, 8, … of the split.
    assert_eq!(&plan.train_tasks[..4], &[0, 3, 5, 8]);
    assert_eq!(plan.train_tasks.len(), 20);
    assert_eq!(plan.env.tasks.context_window, 256);
    let mut sandbox =
        fathom_env::sandbox::SandboxConfig::new(fathom_env::sandbox::WorkerCommand::CurrentExe);
    plan.sandbox.apply(&mut sandbox);
    assert_eq!(sandbox.limits.max_output_chars, 800);
    // The recipe survives a round trip through its own serialisation.
    let recipe = Recipe::parse(&tiny(), "tiny.ron").unwrap();
    assert_eq!(Recipe::parse(&recipe.to_ron(), "again").unwrap(), recipe);
}

/// Asserts that the message names `field` and puts it on `line`.
fn assert_names(message: &str, field: &str, line: usize) {
    assert!(message.contains(field), "{field:?} not named in: {message}");
    assert!(
        message.starts_with(&format!("tiny.ron:{line}:")),
        "line {line} expected: {message}"
    );
}

#[test]
fn unknown_fields_are_named_with_their_line() {
    let text = edited(
        "        group_size: 2,\n",
        "        group_size: 2,\n        groop_size: 3,\n",
    );
    let m = error(&text);
    assert_names(&m, "groop_size", line_of_text(&text, "groop_size"));
    assert!(m.contains("`grpo`") && m.contains("expected one of"), "{m}");
    // Deep inside a section shared with another crate (rewards).
    let text = edited("FormatGate(weight: 0.1)", "FormatGate(wieght: 0.1)");
    let m = error(&text);
    assert_names(&m, "wieght", line_of_text(&text, "wieght"));
    assert!(m.contains("rewards.components[0]"), "{m}");
    // At the top level.
    let text = edited(
        "    remote: None,\n",
        "    remote: None,\n    remotes: None,\n",
    );
    assert_names(&error(&text), "remotes", line_of_text(&text, "remotes"));
}

#[test]
fn missing_fields_are_named_with_their_line() {
    let text = edited("        max_new_tokens: 32,\n", "");
    let m = error(&text);
    assert!(m.contains("missing field `grpo.max_new_tokens`"), "{m}");
    // The line reported is inside the grpo section.
    let line: usize = m.split(':').nth(1).unwrap().parse().unwrap();
    assert!(
        (line_of_text(&text, "    grpo: (")..line_of_text(&text, "    rapo: (")).contains(&line),
        "{m}"
    );
    let text = edited("    seeds: (model: 0, data: 1, sampling: 2),\n", "");
    assert!(
        error(&text).contains("missing field `seeds`"),
        "{}",
        error(&text)
    );
}

#[test]
fn wrong_types_name_the_field() {
    let text = edited("max_new_tokens: 32", "max_new_tokens: \"lots\"");
    let m = error(&text);
    assert_names(&m, "grpo.max_new_tokens", line_of_text(&text, "\"lots\""));
    let text = edited("normalization: TokenLevel", "normalization: TokenLvl");
    let m = error(&text);
    assert_names(
        &m,
        "grpo.loss.normalization",
        line_of_text(&text, "TokenLvl"),
    );
    assert!(m.contains("TokenLvl") && m.contains("DrGrpo"), "{m}");
    let text = edited(
        "families: [needle, compare]",
        "families: [needle, comparison]",
    );
    assert_names(
        &error(&text),
        "comparison",
        line_of_text(&text, "comparison"),
    );
}

#[test]
fn bad_values_are_named_with_their_line() {
    for (from, to, field, marker) in [
        (
            "optimizer: (lr: 1e-3, weight_decay: 0.0, betas: (0.9, 0.99)",
            "optimizer: (lr: -1e-3, weight_decay: 0.0, betas: (0.9, 0.99)",
            "grpo.optimizer.lr",
            "lr: -1e-3",
        ),
        (
            "saturate_tokens: 2048",
            "saturate_tokens: 100",
            "rewards.components[2].saturate_tokens",
            "saturate_tokens: 100",
        ),
        ("rank: 16,", "rank: 0,", "model.tuning.rank", "rank: 0"),
        (
            "embedding_std: Some(0.25)",
            "embedding_std: Some(-1.0)",
            "model.source.embedding_std",
            "embedding_std: Some(-1.0)",
        ),
        (
            "train: (split: train, count: 20)",
            "train: (split: train, count: 5000)",
            "data.train.count",
            "count: 5000",
        ),
        (
            "group_size: 2,",
            "group_size: 1,",
            "grpo.group_size",
            "group_size: 1",
        ),
        (
            "epsilon_low: 0.2",
            "epsilon_low: 1.5",
            "grpo.loss.epsilon_low",
            "epsilon_low: 1.5",
        ),
        (
            "schedule: (warmup_steps: 0, decay: Constant)",
            "schedule: (warmup_steps: 9, decay: Constant)",
            "grpo.schedule.warmup_steps",
            "warmup_steps: 9",
        ),
        (
            "remote: None",
            "remote: Some(urls: [\"ftp://example\"], token_file: None)",
            "remote.urls",
            "ftp://",
        ),
        (
            "step_timeout_s: 5.0",
            "step_timeout_s: -1.0",
            "env.step_timeout_s",
            "-1.0",
        ),
        (
            "heldout: (split: heldout",
            "heldout: (split: train",
            "data.heldout.split",
            "heldout: (split: train",
        ),
        (
            "learner: (activation_checkpointing: false, logprob_chunk: 256)",
            "learner: (activation_checkpointing: false, logprob_chunk: 256, pass_tokens: Some(0))",
            "sft.learner.pass_tokens",
            "pass_tokens: Some(0)",
        ),
        (
            "wasteful_fraction: 0.25)",
            "wasteful_fraction: 0.25, llm_share: 1.5)",
            "sft.traces.llm_share",
            "llm_share: 1.5",
        ),
    ] {
        let text = edited(from, to);
        assert_names(&error(&text), field, line_of_text(&text, marker));
    }
}

#[test]
fn counted_hops_need_short_searches() {
    let text = edited(
        "wasteful_fraction: 0.25)",
        "wasteful_fraction: 0.25, count_hops: true)",
    );
    assert_names(
        &error(&text),
        "sft.traces.count_hops",
        line_of_text(&text, "count_hops: true"),
    );
    assert!(
        error(&text).contains("short_search: true"),
        "{}",
        error(&text)
    );
    let counted = text.replacen(
        "count_hops: true",
        "short_search: true, count_hops: true",
        1,
    );
    let plan = Plan::from_text(&counted, "tiny.ron").unwrap();
    assert!(plan.sft.is_some_and(|s| s.traces.count_hops));
}

#[test]
fn tallied_hops_need_short_searches() {
    let text = edited(
        "wasteful_fraction: 0.25)",
        "wasteful_fraction: 0.25, tally_hops: true)",
    );
    assert_names(
        &error(&text),
        "sft.traces.tally_hops",
        line_of_text(&text, "tally_hops: true"),
    );
    let tallied = text.replacen(
        "tally_hops: true",
        "short_search: true, tally_hops: true",
        1,
    );
    let plan = Plan::from_text(&tallied, "tiny.ron").unwrap();
    assert!(plan.sft.is_some_and(|s| s.traces.tally_hops));
}

#[test]
fn multi_hop_detours_need_six_turns() {
    let text = tiny()
        .replacen(
            "families: [needle, compare]",
            "families: [needle, multi_hop]",
            1,
        )
        .replacen(
            "wasteful_fraction: 0.25)",
            "wasteful_fraction: 0.25, short_search: true, multi_hop_detours: true)",
            1,
        );
    assert_names(
        &error(&text),
        "sft.traces.multi_hop_detours",
        line_of_text(&text, "multi_hop_detours: true"),
    );
    assert!(
        error(&text).contains("at least 6, got 4"),
        "{}",
        error(&text)
    );
    let six = text.replacen("max_turns: 4,", "max_turns: 6,", 1);
    Plan::from_text(&six, "tiny.ron").unwrap();
    // Without multi-hop tasks, or without short searches, the setting changes no trace.
    let needle_only = text.replacen("[needle, multi_hop]", "[needle, compare]", 1);
    Plan::from_text(&needle_only, "tiny.ron").unwrap();
}

#[test]
fn max_hops_keeps_short_chains_only() {
    let two_families = edited(
        "families: [needle, compare]",
        "families: [needle, multi_hop]",
    );
    let text = two_families.replacen(
        "max_window_factor: 3.0,",
        "max_window_factor: 3.0,\n        max_hops: Some(2),",
        1,
    );
    let all = Plan::from_text(&two_families, "tiny.ron").unwrap();
    let short = Plan::from_text(&text, "tiny.ron").unwrap();
    let hops = |plan: &Plan, split: Split, indices: &[usize]| -> Vec<Option<usize>> {
        indices
            .iter()
            .map(|&i| {
                let task = fathom_env::tasks::split_task(split, i, &plan.env.tasks).unwrap();
                match fathom_env::expert::plan(&task.question).unwrap() {
                    fathom_env::expert::Plan::MultiHop { hops, .. } => Some(hops),
                    _ => None,
                }
            })
            .collect()
    };
    for (plan_all, plan_short, split) in [
        (&all.train_tasks, &short.train_tasks, Split::Train),
        (&all.eval_tasks, &short.eval_tasks, Split::Eval),
        (&all.heldout_tasks, &short.heldout_tasks, Split::Heldout),
    ] {
        // The same count, every chain of two hops, and the needle tasks those of the unfiltered
        // selection in their order.
        assert_eq!(plan_all.len(), plan_short.len());
        let kept = hops(&short, split, plan_short);
        assert!(kept.iter().flatten().all(|&h| h == 2), "{kept:?}");
        assert!(kept.iter().any(|h| h.is_some()) && kept.iter().any(|h| h.is_none()));
        let unfiltered = hops(&all, split, plan_all);
        assert!(
            unfiltered.iter().flatten().any(|&h| h > 2),
            "{unfiltered:?}"
        );
        let needles = |indices: &[usize], hops: &[Option<usize>]| -> Vec<usize> {
            indices
                .iter()
                .zip(hops)
                .filter(|(_, h)| h.is_none())
                .map(|(&i, _)| i)
                .collect()
        };
        let (a, b) = (needles(plan_all, &unfiltered), needles(plan_short, &kept));
        assert_eq!(a[..a.len().min(b.len())], b[..a.len().min(b.len())]);
    }
    // Four hops is the generator's longest chain: the selection is the unfiltered one.
    let four = text.replacen("Some(2)", "Some(4)", 1);
    assert_eq!(
        Plan::from_text(&four, "tiny.ron").unwrap().train_tasks,
        all.train_tasks
    );
    // No chain is shorter than two hops.
    let one = text.replacen("Some(2)", "Some(1)", 1);
    assert_names(
        &error(&one),
        "data.max_hops",
        line_of_text(&one, "max_hops"),
    );
    assert!(error(&one).contains("at least 2 hops"), "{}", error(&one));
    // Without multi-hop tasks the setting limits nothing, which is a mistake worth naming.
    let needle_only = text.replacen("[needle, multi_hop]", "[needle, compare]", 1);
    assert!(error(&needle_only).contains("does not list multi_hop"));
    // A count beyond what the filter leaves names the count and says why.
    let held = short_held_out_available(&text);
    let too_many = text.replacen(
        "heldout: (split: heldout, count: 8)",
        &format!("heldout: (split: heldout, count: {})", held + 1),
        1,
    );
    let message = error(&too_many);
    assert_names(
        &message,
        "data.heldout.count",
        line_of_text(&too_many, "heldout: (split"),
    );
    assert!(
        message.contains(&format!("between 1 and {held}")),
        "{message}"
    );
    assert!(message.contains("chain lengths"), "{message}");
    // Exactly as many as the filter leaves is valid, and the plan uses every one of them.
    let all = text.replacen(
        "heldout: (split: heldout, count: 8)",
        &format!("heldout: (split: heldout, count: {held})"),
        1,
    );
    let plan = Plan::from_text(&all, "tiny.ron").unwrap();
    assert_eq!(plan.heldout_tasks.len(), held);
}

/// How many held-out tasks `text`'s families and `max_hops` leave.
fn short_held_out_available(text: &str) -> usize {
    let recipe = Recipe::parse(text, "tiny.ron").unwrap();
    let available = recipe.data.available(Split::Heldout);
    // Fewer than the split's two families would give (200 of 500), more than none.
    assert!(available > 8 && available < 200, "{available}");
    available
}

#[test]
fn full_fine_tuning_needs_dense_weights() {
    let mut text = tiny();
    let start = text.find("        tuning: Lora(").unwrap();
    let end = start + text[start..].find("        ),\n").unwrap() + "        ),\n".len();
    text.replace_range(start..end, "        tuning: Full,\n");
    assert!(Plan::from_text(&text, "tiny.ron").is_ok());
    let text = text.replacen(
        "quantization: Dense,",
        "quantization: Nf4(double_quant: false),",
        1,
    );
    assert_names(
        &error(&text),
        "model.tuning",
        line_of_text(&text, "tuning: Full"),
    );
}

#[test]
fn a_starting_adapter_needs_lora_tuning() {
    let text = edited(
        "        quantization: Dense,\n",
        "        quantization: Dense,\n        adapter: Some(\"runs/sft/adapter\"),\n",
    );
    let plan = Plan::from_text(&text, "tiny.ron").unwrap();
    assert_eq!(
        plan.model.adapter.as_deref(),
        Some(std::path::Path::new("runs/sft/adapter"))
    );
    assert_eq!(
        Plan::from_text(&tiny(), "tiny.ron").unwrap().model.adapter,
        None
    );
    let start = text.find("        tuning: Lora(").unwrap();
    let end = start + text[start..].find("        ),\n").unwrap() + "        ),\n".len();
    let mut full = text.clone();
    full.replace_range(start..end, "        tuning: Full,\n");
    assert_names(
        &error(&full),
        "model.adapter",
        line_of_text(&full, "adapter: Some"),
    );
}

#[test]
fn a_doubly_wrapped_some_gets_a_hint() {
    let text = edited("    sft: Some(\n", "    sft: Some((\n").replacen(
        "    ),\n    grpo:",
        "    )),\n    grpo:",
        1,
    );
    let m = error(&text);
    assert!(m.contains("Some(steps: 10"), "{m}");
    assert!(
        m.starts_with(&format!("tiny.ron:{}:", line_of_text(&text, "sft: Some(("))),
        "{m}"
    );
}

#[test]
fn syntax_errors_have_a_position() {
    let text = edited(
        "    device: (backend: Cpu, index: 0),\n",
        "    device: (backend: Cpu index: 0),\n",
    );
    let m = error(&text);
    let line = line_of_text(&text, "backend: Cpu index");
    assert!(m.starts_with(&format!("tiny.ron:{line}:")), "{m}");
}

#[test]
fn a_seed_offset_moves_every_seed_and_is_recorded_in_the_text() {
    let plan = Plan::from_text(&tiny(), "tiny.ron").unwrap();
    let (seeds, tasks) = (plan.seeds.clone(), plan.heldout_tasks.clone());
    let moved = Plan::from_text(&tiny(), "tiny.ron")
        .unwrap()
        .with_seed_offset(2);
    assert_eq!(moved.seeds.model, seeds.model + 2);
    assert_eq!(moved.seeds.data, seeds.data + 2);
    assert_eq!(moved.seeds.sampling, seeds.sampling + 2);
    assert_eq!(moved.heldout_tasks, tasks);
    // The saved text still parses, to the original seeds, and says which were used.
    let reparsed = Plan::from_text(&moved.text, "saved").unwrap();
    assert_eq!(reparsed.seeds, seeds);
    assert!(
        moved.text.contains("Run with seed offset 2"),
        "{}",
        moved.text
    );
    assert_eq!(plan.with_seed_offset(0).text, tiny());
}
