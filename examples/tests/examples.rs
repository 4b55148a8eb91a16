//! The example recipes and fixtures, scored exactly as `cargo xtask score` scores them.
//!
//! The JSON fixtures under `examples/<name>/` are made by the builder functions below; the
//! `fixtures_match_their_builders` test fails when they drift. To rewrite them after changing a
//! builder, run
//! `FATHOM_BLESS=1 cargo test -p fathom-examples --test examples fixtures_match_their_builders`.

use std::path::{Path, PathBuf};

use fathom_rewards::fixture::{TrajectoryBuilder, task};
use fathom_rewards::record::{Family, Span, Task, Trajectory};
use fathom_rewards::{Composite, RewardRegistry, rewards_from_recipe};

const DOCUMENT: &str = "INVENTORY LOG\n\
record 101: owner=Ada Vance; vault=3\n\
record 102: owner=Bram Holt; vault=9\n\
record 103: owner=Cleo Marsh; vault=4\n\
record 104: owner=Dov Reyes; vault=7\n";

fn with_question(mut traj: Trajectory, question: &str) -> Trajectory {
    traj.messages[0].content = "You answer questions about `context`, a long document, by running \
        Python in a ```repl``` block; put the final answer in <answer>…</answer>."
        .to_owned();
    traj.messages[1].content = format!(
        "{question}\n\n`context` holds {} characters.",
        DOCUMENT.len()
    );
    traj
}

fn grounded_task() -> Task {
    let mut t = task(
        "train-00042",
        Family::Needle,
        DOCUMENT,
        "Who owns record 103?",
        "Cleo Marsh",
    );
    t.index = 42;
    t.seed = 42;
    t.evidence = vec![Span {
        start: 88,
        end: 125,
    }];
    t
}

fn grounded_found() -> Trajectory {
    let traj = TrajectoryBuilder::new("train-00042")
        .code(
            "i = context.find(\"record 103\")\nprint(context[i:i + 40])",
            "record 103: owner=Cleo Marsh; vault=4\nre\n",
        )
        .find("record 103", 0, DOCUMENT.len())
        .slice(88, 128)
        .answer("Record 103 names its owner.\n<answer>Cleo Marsh</answer>")
        .build();
    with_question(traj, &grounded_task().question)
}

fn grounded_typed() -> Trajectory {
    let traj = TrajectoryBuilder::new("train-00042")
        .code("print(\"Cleo Marsh\")", "Cleo Marsh\n")
        .answer("<answer>Cleo Marsh</answer>")
        .build();
    with_question(traj, &grounded_task().question)
}

fn family_task() -> Task {
    let mut t = task(
        "train-00043",
        Family::Aggregate,
        DOCUMENT,
        "How many records have a vault number above 5?",
        "2",
    );
    t.index = 43;
    t.seed = 43;
    t.aliases = vec!["two".to_owned()];
    t.evidence = vec![
        Span { start: 51, end: 87 },
        Span {
            start: 126,
            end: 162,
        },
    ];
    t
}

fn family_counted() -> Trajectory {
    let traj = TrajectoryBuilder::new("train-00043")
        .code(
            "import re\nvaults = [int(v) for v in re.findall(r\"vault=(\\d+)\", context)]\nprint(sum(v > 5 for v in vaults))",
            "2\n",
        )
        .search("vault=(\\d+)", 0, DOCUMENT.len())
        .answer("<answer>2</answer>")
        .build();
    with_question(traj, &family_task().question)
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn fixtures() -> Vec<(&'static str, String)> {
    let json = |v: &dyn erased::Json| v.to_json();
    vec![
        ("grounded/task.json", json(&grounded_task())),
        ("grounded/trajectory.json", json(&grounded_found())),
        ("grounded/trajectory-typed.json", json(&grounded_typed())),
        ("family/task.json", json(&family_task())),
        ("family/trajectory.json", json(&family_counted())),
    ]
}

mod erased {
    /// Pretty JSON of a record, with a trailing newline.
    pub trait Json {
        fn to_json(&self) -> String;
    }
    impl<T: serde::Serialize> Json for T {
        fn to_json(&self) -> String {
            serde_json::to_string_pretty(self).expect("records serialise") + "\n"
        }
    }
}

#[test]
fn fixtures_match_their_builders() {
    let bless = std::env::var_os("FATHOM_BLESS").is_some();
    for (path, expected) in fixtures() {
        let path = root().join(path);
        if bless {
            std::fs::write(&path, &expected).unwrap();
        }
        let committed =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(
            committed,
            expected,
            "{} is stale: rerun with FATHOM_BLESS=1",
            path.display()
        );
    }
}

/// What `xtask score --task T --trajectory J --recipe R` computes.
fn score(recipe: Option<&str>, task: &str, trajectory: &str) -> serde_json::Value {
    let mut registry = RewardRegistry::new();
    fathom_examples::register(&mut registry).unwrap();
    let composite: Composite = match recipe {
        Some(path) => {
            let text = std::fs::read_to_string(root().join(path)).unwrap();
            rewards_from_recipe(&text)
                .unwrap()
                .build(&registry)
                .unwrap()
        }
        None => Composite::default(),
    };
    let task: Task =
        serde_json::from_str(&std::fs::read_to_string(root().join(task)).unwrap()).unwrap();
    let traj: Trajectory =
        serde_json::from_str(&std::fs::read_to_string(root().join(trajectory)).unwrap()).unwrap();
    serde_json::to_value(composite.score(&task, &traj).unwrap()).unwrap()
}

fn close(value: &serde_json::Value, expected: f64) -> bool {
    (value.as_f64().unwrap() - expected).abs() < 1e-9
}

#[test]
fn grounded_recipe_pays_found_answers_more_than_typed_ones() {
    let recipe = Some("grounded/recipe.ron");
    let found = score(recipe, "grounded/task.json", "grounded/trajectory.json");
    assert_eq!(found["components"]["grounded"], 1.0);
    assert!(close(&found["total"], 0.95), "{found}");
    let typed = score(
        recipe,
        "grounded/task.json",
        "grounded/trajectory-typed.json",
    );
    assert_eq!(typed["components"]["grounded"], 0.0);
    assert_eq!(typed["components"]["correctness"], 1.0);
    assert!(close(&typed["total"], 0.75), "{typed}");
    // The default composite cannot tell them apart.
    let default_found = score(None, "grounded/task.json", "grounded/trajectory.json");
    let default_typed = score(None, "grounded/task.json", "grounded/trajectory-typed.json");
    assert_eq!(default_found["total"], default_typed["total"]);
}

#[test]
fn family_recipe_weights_by_family() {
    let recipe = Some("family/recipe.ron");
    let aggregate = score(recipe, "family/task.json", "family/trajectory.json");
    assert_eq!(aggregate["components"]["family_weighted"], 1.5);
    assert!(
        close(&aggregate["total"], 0.1 + 0.5 * 1.5 + 0.15),
        "{aggregate}"
    );
    let needle = score(recipe, "grounded/task.json", "grounded/trajectory.json");
    assert_eq!(needle["components"]["family_weighted"], 1.0);
    assert!(close(&needle["total"], 0.1 + 0.5 + 0.15), "{needle}");
    let keys: Vec<&String> = aggregate["components"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(keys.len(), 4);
}

#[test]
fn example_recipes_need_their_rewards_registered() {
    for recipe in ["grounded/recipe.ron", "family/recipe.ron"] {
        let text = std::fs::read_to_string(root().join(recipe)).unwrap();
        let err = rewards_from_recipe(&text)
            .unwrap()
            .build(&RewardRegistry::new())
            .unwrap_err();
        assert!(
            err.to_string().contains("no custom reward named"),
            "{recipe}: {err}"
        );
    }
}
